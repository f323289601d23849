"""End to end: a real uvicorn server over the real engine (tiny random Llama, graphs compiled through dynamo
with the "dynamo-eager" backend), a scripted set of requests, then /metrics parsed with prometheus_client:
every value must be exactly what the requests imply. Requests run one after another, so each prefill has
one real row (prefill batch bucket 1) and each decode step one active row (decode batch bucket 1)."""

from __future__ import annotations

import importlib.metadata
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from buckets import BucketTable, GraphKey
from buckets.scheduler import DecodeStep
from server.metrics.config import ABORT_REASONS, FINISH_REASONS, RECOMPILE_REASONS, REJECT_REASONS
from tests.helm.metric_names import METRICS, metric_of, series_names
from tests.support.served import Outcome, Served, assert_warmed_exactly, changed, eventually, generate, serve, words
from tests.support.tiny import TINY_SERVED_TABLE, TINY_TABLE, build_tiny_checkpoint, tiny_settings

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
# (route, body): both endpoints, streaming and not, prompts in every length bucket (one exactly at a
# boundary), and one request whose single token comes from the prefill alone (no decode step).
SCRIPT: list[tuple[str, dict[str, Any]]] = [
    (CMPL, {"prompt": words(3), "max_tokens": 4}),
    (CMPL, {"prompt": words(8), "max_tokens": 3, "stream": True}),
    (CMPL, {"prompt": words(12), "max_tokens": 5}),
    (CMPL, {"prompt": words(30), "max_tokens": 2, "stream": True}),
    (CMPL, {"prompt": words(TINY_TABLE.max_length), "max_tokens": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3}),
    (CHAT, {"messages": [{"role": "system", "content": words(20)}, {"role": "user", "content": "the cat sat"}],
            "max_tokens": 4, "stream": True}),
]
OVER_LIMIT = (CMPL, {"prompt": words(TINY_TABLE.max_length + 1), "max_tokens": 1})
SMALL_TABLE = BucketTable(lengths=(8, 16), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=32,
                          mixed_tokens=(8, 16, 32),  # the CPU default: the length buckets, then a solo bucket
                          draft_rows=3)  # and speculative decoding's: 3 drafts for the one slot
UNWARMED = GraphKey("prefill", 1, 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(Path(tmp_path_factory.mktemp("metrics-e2e")) / "tiny-llama")


@pytest.fixture(scope="module")
def live(checkpoint: str) -> Iterator[Served]:
    # Prefix caching off: the script's prompts share prefixes (words(n) begins with words(m) for m < n), and
    # its exact prefill padding counts prefill steps (tests/server/engine/test_prefix_caching.py serves it on).
    settings = tiny_settings(model=checkpoint, compile_backend="dynamo-eager", enable_prefix_caching=False)
    with serve(settings) as served:
        assert served.engine.table == TINY_SERVED_TABLE  # mixed steps on: sequential requests below never mix
        yield served


@dataclass(frozen=True)
class Expect:
    """What a list of successful, sequential requests must add to the metrics."""

    outcomes: list[Outcome]

    @property
    def per_bucket(self) -> Counter[int]:
        return Counter(o.bucket for o in self.outcomes)

    @property
    def prompt_tokens(self) -> int:
        return sum(o.prompt_tokens for o in self.outcomes)

    @property
    def completion_tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outcomes)

    @property
    def prefill_padding(self) -> int:
        return sum(o.bucket - o.prompt_tokens for o in self.outcomes)

    @property
    def decode_steps(self) -> int:  # the first token of each request comes from its prefill
        return sum(o.completion_tokens - 1 for o in self.outcomes)


def test_scripted_requests_give_exact_metrics(live: Served) -> None:
    before = live.scrape()
    outcomes = []
    for route, body in SCRIPT:
        out = generate(live.url, route, body)
        assert out.status == 200, out.body
        assert out.completion_tokens == body["max_tokens"]  # ignore_eos: generation runs to max_tokens
        assert out.bucket == TINY_TABLE.length_for(out.prompt_tokens) and out.padded == out.bucket - out.prompt_tokens
        outcomes.append(out)
    assert [o.prompt_tokens for o in outcomes[:5]] == [3, 8, 12, 30, TINY_TABLE.max_length]
    over = generate(live.url, *OVER_LIMIT)
    assert over.status == 400 and over.body["error"]["code"] == "context_length_exceeded"
    exp = Expect(outcomes)
    assert set(exp.per_bucket) == set(TINY_TABLE.lengths)  # the script covers every length bucket
    assert eventually(lambda: live.scrape().get("bucketserve_requests_running") == 0)
    after = live.scrape()

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    # HTTP responses, by route template and status (the scrapes themselves aside)
    http = {dict(lb)["endpoint"] + " " + dict(lb)["status"]: v
            for lb, v in changed(before, after, "bucketserve_requests_total").items()
            if dict(lb)["endpoint"] != "/metrics"}
    assert http == {f"{CMPL} 200": 5, f"{CHAT} 200": 2, f"{CMPL} 400": 1}
    assert delta("bucketserve_requests_over_limit_total") == 1
    # shapes and padding
    for n in TINY_TABLE.lengths:
        assert delta("bucketserve_bucket_requests_total", bucket=str(n)) == exp.per_bucket[n], n
        assert delta("bucketserve_time_to_first_token_seconds_count", bucket=str(n)) == exp.per_bucket[n], n
        assert delta("bucketserve_request_duration_seconds_count", bucket=str(n)) == exp.per_bucket[n], n
    assert delta("bucketserve_prompt_tokens_total") == exp.prompt_tokens
    assert delta("bucketserve_prompt_length_count") == len(outcomes)
    assert delta("bucketserve_prompt_length_sum") == exp.prompt_tokens
    assert delta("bucketserve_padding_tokens_total", phase="prefill") == exp.prefill_padding
    assert delta("bucketserve_padding_tokens_total", phase="decode") == 0  # one request at a time: batch 1
    assert delta("bucketserve_generation_tokens_total") == exp.completion_tokens
    # steps: one prefill per request, one decode step per token after the first
    assert delta("bucketserve_queue_wait_seconds_count") == len(outcomes)
    assert delta("bucketserve_prefill_seconds_count") == len(outcomes)
    assert delta("bucketserve_decode_step_seconds_count") == exp.decode_steps
    assert delta("bucketserve_inter_token_latency_seconds_count") == exp.decode_steps
    assert delta("bucketserve_batch_occupancy_count") == exp.decode_steps
    assert delta("bucketserve_batch_occupancy_sum") == exp.decode_steps  # every step full: 1 row of 1
    # how requests ended
    for reason in FINISH_REASONS:
        assert delta("bucketserve_requests_finished_total", finish_reason=reason) == (
            len(outcomes) if reason == "length" else 0), reason
    for reason in ABORT_REASONS:
        assert delta("bucketserve_requests_aborted_total", reason=reason) == 0, reason
    for reason in REJECT_REASONS:
        assert delta("bucketserve_requests_rejected_total", reason=reason) == 0, reason
    # load, once the engine is idle again
    assert after.get("bucketserve_requests_waiting") == 0
    assert eventually(lambda: live.scrape().get("bucketserve_slots_free") == TINY_TABLE.max_batch)
    # compilation: every graph of the table once at warm-up, none since
    assert_warmed_exactly(after, live.engine.table, list(live.engine.table.graph_keys()))
    assert after.get("bucketserve_graphs") == live.engine.table.num_graphs
    for reason in RECOMPILE_REASONS:
        assert after.get("bucketserve_recompilations_total", reason=reason) == 0, reason
    assert live.engine.model.accountant.count("serving") == 0


def test_info_labels(live: Served, checkpoint: str) -> None:
    (labels,) = live.scrape().series("bucketserve_info")
    try:
        version = importlib.metadata.version("bucketserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    assert dict(labels) == {
        "model": Path(checkpoint).name, "dtype": "float32", "device": "cpu", "compile_backend": "dynamo-eager",
        "version": version, "lengths": ",".join(map(str, TINY_TABLE.lengths)),
        "batch_sizes": ",".join(map(str, TINY_TABLE.batch_sizes)),
        "prefill_batch_sizes": ",".join(map(str, TINY_TABLE.prefill_batch_sizes)),
        "kv_lengths": ",".join(map(str, TINY_TABLE.kv_lengths)),
        "context_length": str(TINY_TABLE.context_length), "threads": "1", "tensor_parallel_size": "1",
        "world_size": "1",
    }
    assert live.scrape().get("bucketserve_info", **dict(labels)) == 1


def test_scrapes_and_probes_are_not_counted_as_requests(live: Served) -> None:
    """requests_total is traffic: a scrape or a probe leaves it as it was (they would dilute the error ratio the
    README's alert divides by); any other route, /v1/models here, counts once a response."""
    before = live.scrape()
    for path in ("/metrics", "/health", "/ready", "/metrics"):
        assert httpx.get(live.url + path, timeout=10).status_code == 200
    assert httpx.get(live.url + "/v1/models", timeout=10).status_code == 200
    after = live.scrape()
    assert changed(before, after, "bucketserve_requests_total") == {(("endpoint", "/v1/models"), ("status", "200")): 1}
    endpoints = {dict(labels).get("endpoint") for labels in after.series("bucketserve_requests_total")}
    assert not endpoints & {"/metrics", "/health", "/ready"}


def test_every_dashboard_metric_is_exported(live: Served) -> None:
    """tests/helm/metric_names.py is what the Grafana dashboard queries: all of it on /metrics, with the
    documented type and labels, and nothing on /metrics that the list does not know."""
    assert httpx.get(live.url + "/v1/models", timeout=10).status_code == 200  # requests_total exists lazily
    s = live.scrape()
    names = s.names()
    for name, (kind, labels) in METRICS.items():
        wanted = series_names(name)
        assert set(wanted) <= names, (name, set(wanted) - names)
        (family,) = [f for f in s.families.values() if any(n in wanted for n, _ in f.samples)]
        # the Prometheus text format has no info type: prometheus_client writes an Info as a gauge
        assert family.type == ("gauge" if kind == "info" else kind), (name, family.type)
        if kind != "info":  # info labels are free-form (checked in test_info_labels)
            for (_, lb) in family.samples:
                assert {k for k, _ in lb} - {"le"} == set(labels), (name, lb)
    unknown = {n for n in names if n.startswith("bucketserve_") and metric_of(n) is None}
    assert not unknown, unknown


def _stop_on_last_token(url: str) -> tuple[str, str]:
    """(prompt, stop string) where greedy generation of 4 tokens first completes the stop string on its 4th: the
    shortest suffix of the 4-token text that the 3-token text does not hold (tiny random weights: some prompts'
    4th token adds no text, so a few are tried)."""
    for n in range(3, 12):
        prompt = words(n)
        texts = [generate(url, CMPL, {"prompt": prompt, "max_tokens": m}).body["choices"][0]["text"] for m in (3, 4)]
        if texts[1].startswith(texts[0]) and len(texts[1]) > len(texts[0]):
            stop = next(texts[1][-k:] for k in range(1, len(texts[1]) + 1) if texts[1][-k:] not in texts[0])
            return prompt, stop
    raise AssertionError("no prompt of 3-11 words adds text with its 4th token")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_on_the_last_token_is_counted_as_stop(live: Served, stream: bool) -> None:
    """A stop string completed by the last allowed token: the answer says `stop`, and so must the finish metric
    and the request log (the engine ends the request as `length` before the HTTP layer matches the text)."""
    prompt, stop = _stop_on_last_token(live.url)
    before = live.scrape()
    out = generate(live.url, CMPL, {"prompt": prompt, "max_tokens": 4, "stop": [stop], "stream": stream})
    assert out.status == 200 and out.completion_tokens == 4
    finals = [c["finish_reason"] for e in (out.body if stream else [out.body]) for c in e.get("choices", [])
              if c.get("finish_reason")]
    assert finals == ["stop"]
    assert eventually(lambda: changed(before, live.scrape(), "bucketserve_requests_finished_total")
                      == {(("finish_reason", "stop"),): 1})
    assert eventually(lambda: live.scrape().get("bucketserve_requests_running") == 0)
    after = live.scrape()
    assert changed(before, after, "bucketserve_requests_finished_total") == {(("finish_reason", "stop"),): 1}
    assert changed(before, after, "bucketserve_requests_aborted_total") == {}
    assert after.get("bucketserve_generation_tokens_total") - before.get("bucketserve_generation_tokens_total") == 4
    assert not live.engine._book._held  # nothing left waiting for a client


def test_client_abort_is_counted(live: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps wait on a gate, so the client sees exactly one token (from the prefill) before it
    goes away: the abort, its one generated token and its latency series are counted exactly."""
    gate = threading.Event()
    run_step = live.engine.model.run_step

    def gated(step: Any, prompt_of: Any, **kwargs: Any) -> Any:
        if isinstance(step, DecodeStep):
            gate.wait(30)
        return run_step(step, prompt_of, **kwargs)

    monkeypatch.setattr(live.engine.model, "run_step", gated)
    before = live.scrape()
    body = {"prompt": words(5), "max_tokens": 50, "stream": True, "logprobs": 0, "temperature": 0,
            "ignore_eos": True}  # logprobs: every token yields a chunk, even one with no text yet
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            with client.stream("POST", CMPL, json=body) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line.startswith("data: "))
        assert eventually(lambda: live.scrape().get("bucketserve_requests_aborted_total", reason="client")
                          == before.get("bucketserve_requests_aborted_total", reason="client") + 1)
    finally:
        gate.set()
    assert eventually(lambda: live.scrape().get("bucketserve_requests_running") == 0)
    after = live.scrape()
    bucket = str(TINY_TABLE.length_for(5))
    assert changed(before, after, "bucketserve_requests_aborted_total") == {(("reason", "client"),): 1}
    assert changed(before, after, "bucketserve_requests_finished_total") == {(("finish_reason", "abort"),): 1}
    assert changed(before, after, "bucketserve_bucket_requests_total") == {(("bucket", bucket),): 1}
    assert changed(before, after, "bucketserve_time_to_first_token_seconds_count") == {(("bucket", bucket),): 1}
    assert changed(before, after, "bucketserve_request_duration_seconds_count") == {(("bucket", bucket),): 1}
    assert after.get("bucketserve_generation_tokens_total") - before.get("bucketserve_generation_tokens_total") == 1
    assert after.get("bucketserve_prompt_tokens_total") - before.get("bucketserve_prompt_tokens_total") == 5
    http = changed(before, after, "bucketserve_requests_total")
    assert http[(("endpoint", CMPL), ("status", "200"))] == 1
    assert generate(live.url, CMPL, {"prompt": words(2), "max_tokens": 2}).status == 200  # still serving


# -- a graph missing from warm-up ----------------------------------------------------------------------------
@pytest.fixture(params=["allow", "error"])
def partly_warm(request: pytest.FixtureRequest, checkpoint: str) -> Iterator[Served]:
    """A server that warmed every graph of SMALL_TABLE except UNWARMED, under each recompile policy."""
    t = SMALL_TABLE
    settings = tiny_settings(model=checkpoint, compile_backend="dynamo-eager", recompile_policy=request.param,
                             buckets=t.lengths, batch_sizes=t.batch_sizes, prefill_batch_sizes=t.prefill_batch_sizes,
                             max_model_len=t.context_length, kv_buckets=t.kv_lengths)
    warm = [k for k in t.graph_keys() if k != UNWARMED]
    with serve(settings, warm_keys=warm) as served:
        assert served.engine.table == t
        yield served


def test_unwarmed_shape_compiles_once_or_fails_cleanly(partly_warm: Served) -> None:
    live, t = partly_warm, SMALL_TABLE
    policy = live.engine.model.settings.recompile_policy
    warm = [k for k in t.graph_keys() if k != UNWARMED]
    s = live.scrape()
    assert_warmed_exactly(s, t, warm)
    assert generate(live.url, CMPL, {"prompt": words(3), "max_tokens": 3}).status == 200  # a warm bucket

    prompt = words(UNWARMED.length - 2)
    assert t.length_for(UNWARMED.length - 2) == UNWARMED.length
    first = generate(live.url, CMPL, {"prompt": prompt, "max_tokens": 3})
    if policy == "allow":
        assert first.status == 200 and first.completion_tokens == 3 and first.bucket == UNWARMED.length
    else:
        assert first.status == 500, first.body
        assert first.body["error"]["code"] == "engine_error" and first.body["error"]["type"] == "server_error"
        assert "not warmed" in first.body["error"]["message"]
        with httpx.Client(base_url=live.url, timeout=30) as client:
            body = {"prompt": prompt, "max_tokens": 3, "stream": True}
            with client.stream("POST", CMPL, json=body) as r:
                assert r.status_code == 200  # headers went out before the prefill ran
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and '"code":"engine_error"' in data[-2]
    # the same bucket again: allowed, it reuses the graph compiled a moment ago; refused, it is refused again
    again = generate(live.url, CMPL, {"prompt": prompt, "max_tokens": 2})
    assert again.status == (200 if policy == "allow" else 500)
    # the server keeps serving the warm buckets either way
    assert generate(live.url, CMPL, {"prompt": words(5), "max_tokens": 2}).status == 200
    assert httpx.get(live.url + "/health").status_code == 200 and httpx.get(live.url + "/ready").status_code == 200

    s = live.scrape()
    key = {"graph": UNWARMED.phase, "bucket": UNWARMED.bucket}
    compiled_serving = 1 if policy == "allow" else 0
    # allowed: one compile; refused (policy "error"): every one of the 3 attempts is the alert signal
    assert s.get("bucketserve_recompilations_total", reason="unwarmed_shape") == (1 if policy == "allow" else 3)
    assert s.get("bucketserve_recompilations_total", reason="guard_failure") == 0
    assert s.get("bucketserve_graph_compilations_total", **key, phase="serving") == compiled_serving
    assert s.total("bucketserve_graph_compilations_total", phase="serving") == compiled_serving
    assert s.get("bucketserve_compile_seconds_count") == len(warm) + compiled_serving
    assert live.engine.model.accountant.count("serving") == compiled_serving
    unwarmed = str(UNWARMED.length)
    assert s.get("bucketserve_bucket_requests_total", bucket=unwarmed) == (2 if policy == "allow" else 3)
    if policy == "allow":
        assert s.get("bucketserve_requests_total", endpoint=CMPL, status="200") == 4
        assert s.get("bucketserve_time_to_first_token_seconds_count", bucket=unwarmed) == 2
        assert s.get("bucketserve_requests_finished_total", finish_reason="error") == 0
    else:
        # every refused request: one error response (the streamed one was 200 with an error event)
        assert s.get("bucketserve_requests_total", endpoint=CMPL, status="500") == 2
        assert s.get("bucketserve_requests_total", endpoint=CMPL, status="200") == 3
        assert s.get("bucketserve_requests_finished_total", finish_reason="error") == 3
        assert s.get("bucketserve_requests_aborted_total", reason="error") == 3
        assert s.get("bucketserve_time_to_first_token_seconds_count", bucket=unwarmed) == 0
        assert s.get("bucketserve_request_duration_seconds_count", bucket=unwarmed) == 3
