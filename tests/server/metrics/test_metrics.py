"""server.metrics.prometheus: drive the hooks with a scripted sequence and read the values back from the exposition
text, the way Prometheus would."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from buckets import BucketTable, GraphKey
from server.metrics.config import INTER_TOKEN_BUCKETS, REQUEST_DURATION_BUCKETS, TTFT_BUCKETS
from server.metrics.prometheus import Metrics, MetricsConfig, MetricsConfigError, prompt_length_edges

INFO = {"model": "tiny", "dtype": "float32", "device": "cpu", "compile_backend": "eager"}
P = "bucketserve_"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def table() -> BucketTable:
    return BucketTable(lengths=(64, 128, 256), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=384)


def make(**kwargs: object) -> Metrics:
    return Metrics(CollectorRegistry(), kwargs.pop("table", table()), info=dict(INFO), **kwargs)  # type: ignore[arg-type]


def samples(m: Metrics) -> Samples:
    body, _ = m.render()
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if not s.name.endswith("_created"):  # creation timestamps differ run to run
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(s: Samples, name: str, **labels: str) -> float:
    return s[(P + name, frozenset(labels.items()))]


def labelsets(s: Samples, name: str) -> set[frozenset[tuple[str, str]]]:
    return {labels for (n, labels) in s if n == P + name}


def edges(s: Samples, name: str, **labels: str) -> list[float]:
    found = [
        float(dict(ls)["le"])
        for (n, ls) in s
        if n == P + name + "_bucket" and {k: v for k, v in ls if k != "le"} == labels
    ]
    return sorted(e for e in found if not math.isinf(e))


def test_scripted_sequence_gives_exact_values() -> None:
    m = make()
    keys = list(m.table.graph_keys())
    for i, key in enumerate(keys):
        m.graph_compiled(key, 0.5, "warmup")
        m.compile_cache(hit=i % 3 == 0)
        m.warmup_progress(i + 1, len(keys))
    m.warmup_finished(12.5)
    m.set_ready(True)
    m.graph_compiled(GraphKey("prefill", 1, 128), 3.0, "serving")
    m.recompiled("unwarmed_shape")
    m.artifact_rejected("corrupt")
    m.artifact_rejected("stale")
    m.artifact_rejected("stale")

    m.request_admitted(64, 50)
    m.request_admitted(128, 100)
    m.request_admitted(128, 65)
    m.request_started(64, 0.01)
    m.request_started(128, 0.2)
    m.request_started(128, 0.2)
    m.prefill_done(GraphKey("prefill", 1, 64), rows=1, padding_tokens=64 - 50, seconds=0.02)
    m.prefill_done(GraphKey("prefill", 2, 128), rows=2, padding_tokens=(128 - 100) + (128 - 65), seconds=0.05)
    m.decode_step_done(batch=4, active=3, seconds=0.004, padding_rows=1)
    m.decode_step_done(batch=2, active=2, seconds=0.003, padding_rows=0)
    m.decode_step_done(batch=4, active=1, seconds=0.004, padding_rows=3)
    m.first_token(64, 1.5)
    m.first_token(128, 2.0)
    m.first_token(128, 0.3)
    m.request_finished(64, 3.0, 5, [0.01, 0.02, 0.03, 0.04], "stop")
    m.request_finished(128, 10.0, 3, [0.5, 0.5], "length")
    m.request_finished(128, 0.4, 1, [], "abort")
    m.request_aborted("client")
    m.set_load(running=2, waiting=3, slots_free=1)
    m.request_rejected("queue_full")
    m.request_rejected("queue_full")
    m.request_over_limit()
    m.http_request("/v1/completions", 200)
    m.http_request("/v1/completions", 200)
    m.http_request("/v1/completions", 429)
    m.http_request("/health", 200)
    s = samples(m)

    # compilation
    for key in keys:
        want = 2.0 if key == GraphKey("prefill", 1, 128) else 1.0
        total = sum(val(s, "graph_compilations_total", graph=key.phase, bucket=key.bucket, phase=p)
                    for p in ("warmup", "serving"))  # fmt: skip
        assert total == want
    assert val(s, "graph_compilations_total", graph="prefill", bucket="b1_l128", phase="serving") == 1
    assert val(s, "graph_compilations_total", graph="decode", bucket="b4_kv384", phase="serving") == 0
    assert val(s, "recompilations_total", reason="unwarmed_shape") == 1
    assert val(s, "recompilations_total", reason="guard_failure") == 0
    assert val(s, "compile_seconds_count") == len(keys) + 1
    assert val(s, "compile_seconds_sum") == pytest.approx(0.5 * len(keys) + 3.0)
    assert val(s, "compile_seconds_bucket", le="0.5") == len(keys)
    assert val(s, "warmup_seconds") == 12.5
    assert val(s, "graphs") == len(keys) == m.table.num_graphs == 15
    assert val(s, "graphs_ready") == len(keys)
    assert val(s, "ready") == 1
    assert val(s, "compile_cache_hits_total") == 5  # i = 0, 3, 6, 9, 12
    assert val(s, "compile_cache_misses_total") == 10
    assert val(s, "compile_artifacts_rejected_total", reason="corrupt") == 1
    assert val(s, "compile_artifacts_rejected_total", reason="stale") == 2

    # shapes
    assert val(s, "bucket_requests_total", bucket="64") == 1
    assert val(s, "bucket_requests_total", bucket="128") == 2
    assert val(s, "bucket_requests_total", bucket="256") == 0
    assert val(s, "prompt_tokens_total") == 215
    assert val(s, "padding_tokens_total", phase="prefill") == 14 + 28 + 63
    assert val(s, "padding_tokens_total", phase="decode") == 4
    assert val(s, "requests_over_limit_total") == 1
    assert val(s, "prompt_length_count") == 3
    assert val(s, "prompt_length_sum") == 215
    assert val(s, "prompt_length_bucket", le="48.0") == 0
    assert val(s, "prompt_length_bucket", le="64.0") == 1
    assert val(s, "prompt_length_bucket", le="96.0") == 2
    assert val(s, "prompt_length_bucket", le="128.0") == 3
    assert val(s, "batch_occupancy_count") == 3
    assert val(s, "batch_occupancy_sum") == pytest.approx(0.75 + 1.0 + 0.25)
    assert val(s, "batch_occupancy_bucket", le="0.25") == 1
    assert val(s, "batch_occupancy_bucket", le="0.75") == 2
    assert val(s, "batch_occupancy_bucket", le="0.625") == 1

    # latency
    assert val(s, "time_to_first_token_seconds_count", bucket="64") == 1
    assert val(s, "time_to_first_token_seconds_count", bucket="128") == 2
    assert val(s, "time_to_first_token_seconds_count", bucket="256") == 0
    assert val(s, "time_to_first_token_seconds_sum", bucket="128") == pytest.approx(2.3)
    assert val(s, "time_to_first_token_seconds_bucket", bucket="128", le="1.0") == 1
    assert val(s, "time_to_first_token_seconds_bucket", bucket="128", le="2.0") == 2  # a 2.0 s TTFT meets "< 2 s"
    assert val(s, "time_to_first_token_seconds_bucket", bucket="64", le="1.0") == 0
    assert val(s, "time_to_first_token_seconds_bucket", bucket="64", le="2.0") == 1
    assert val(s, "inter_token_latency_seconds_count") == 6
    assert val(s, "inter_token_latency_seconds_sum") == pytest.approx(1.1)
    assert val(s, "inter_token_latency_seconds_bucket", le="0.025") == 2
    assert val(s, "request_duration_seconds_count", bucket="128") == 2
    assert val(s, "request_duration_seconds_sum", bucket="128") == pytest.approx(10.4)
    assert val(s, "request_duration_seconds_bucket", bucket="64", le="2.5") == 0
    assert val(s, "request_duration_seconds_bucket", bucket="64", le="5.0") == 1
    assert val(s, "queue_wait_seconds_count") == 3
    assert val(s, "queue_wait_seconds_sum") == pytest.approx(0.41)
    assert val(s, "prefill_seconds_count") == 2
    assert val(s, "prefill_seconds_sum") == pytest.approx(0.07)
    assert val(s, "decode_step_seconds_count") == 3
    assert val(s, "decode_step_seconds_sum") == pytest.approx(0.011)
    assert val(s, "decode_step_seconds_bucket", le="0.001") == 0
    assert val(s, "decode_step_seconds_bucket", le="0.005") == 3

    # load
    assert val(s, "requests_running") == 2
    assert val(s, "requests_waiting") == 3
    assert val(s, "slots_free") == 1
    assert val(s, "generation_tokens_total") == 9
    assert val(s, "requests_finished_total", finish_reason="stop") == 1
    assert val(s, "requests_finished_total", finish_reason="length") == 1
    assert val(s, "requests_finished_total", finish_reason="abort") == 1
    assert val(s, "requests_finished_total", finish_reason="error") == 0
    assert val(s, "requests_aborted_total", reason="client") == 1
    assert val(s, "requests_aborted_total", reason="timeout") == 0
    assert val(s, "requests_rejected_total", reason="queue_full") == 2
    assert val(s, "requests_rejected_total", reason="draining") == 0
    assert val(s, "requests_total", endpoint="/v1/completions", status="200") == 2
    assert val(s, "requests_total", endpoint="/v1/completions", status="429") == 1
    assert val(s, "requests_total", endpoint="/health", status="200") == 1
    assert len(labelsets(s, "requests_total")) == 3


def test_series_exist_at_zero_with_bounded_label_sets() -> None:
    m = make()
    s = samples(m)
    t = m.table
    assert labelsets(s, "bucket_requests_total") == {frozenset({("bucket", str(n))}) for n in t.lengths}
    assert all(v == 0 for (n, _), v in s.items() if n == P + "bucket_requests_total")
    assert labelsets(s, "recompilations_total") == {
        frozenset({("reason", "unwarmed_shape")}),
        frozenset({("reason", "guard_failure")}),
        frozenset({("reason", "other_rank")}),
    }
    assert labelsets(s, "graph_compilations_total") == {
        frozenset({("graph", k.phase), ("bucket", k.bucket), ("phase", p)})
        for k in t.graph_keys()
        for p in ("warmup", "serving")
    }
    assert {dict(ls)["bucket"] for ls in labelsets(s, "graph_compilations_total")} == {
        "b1_kv256", "b1_kv384", "b2_kv256", "b2_kv384", "b4_kv256", "b4_kv384", "b1", "b2", "b4",
        "b1_l64", "b2_l64", "b1_l128", "b2_l128", "b1_l256", "b2_l256",
    }
    ttft_buckets = {dict(ls)["bucket"] for ls in labelsets(s, "time_to_first_token_seconds_count")}
    assert ttft_buckets == {"64", "128", "256"}
    assert labelsets(s, "padding_tokens_total") == {frozenset({("phase", "prefill")}), frozenset({("phase", "decode")})}
    assert labelsets(s, "requests_total") == set()  # route templates appear on first use only
    assert val(s, "graphs") == t.num_graphs
    assert val(s, "graphs_ready") == 0
    assert val(s, "ready") == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.request_admitted(100, 50),  # 100 is no length bucket
        lambda m: m.request_admitted("128", 50),  # labels come from ints of the table, not strings
        lambda m: m.request_admitted(128, 129),  # the prompt does not fit its bucket
        lambda m: m.request_admitted(128, 0),
        lambda m: m.first_token(512, 0.1),
        lambda m: m.request_started(32, 0.1),
        lambda m: m.request_finished(384, 1.0, 1, [], "stop"),
        lambda m: m.request_finished(128, 1.0, 1, [], "cancelled"),
        lambda m: m.request_finished(128, 1.0, -1, [], "stop"),
        lambda m: m.graph_compiled(GraphKey("prefill", 1, 100), 1.0, "warmup"),
        lambda m: m.graph_compiled(GraphKey("decode", 8, 384), 1.0, "warmup"),
        lambda m: m.graph_compiled(GraphKey("decode", 1, 384), 1.0, "later"),
        lambda m: m.graph_compiled(GraphKey("decode", 1, 384), -1.0, "warmup"),
        lambda m: m.recompiled("dynamic_shape"),
        lambda m: m.prefill_done(GraphKey("decode", 1, 384), 1, 0, 0.1),  # a decode key
        lambda m: m.prefill_done(GraphKey("prefill", 2, 64), 3, 0, 0.1),  # more rows than the bucket
        lambda m: m.prefill_done(GraphKey("prefill", 1, 64), 1, 64, 0.1),  # a real row has >= 1 token
        lambda m: m.prefill_done(GraphKey("prefill", 1, 64), 1, -1, 0.1),
        lambda m: m.mixed_done(GraphKey("mixed", 4, 64), 2, 10, 0.1),  # no mixed graphs in this table
        lambda m: m.decode_step_done(3, 1, 0.1, 0),  # 3 is no batch bucket
        lambda m: m.decode_step_done(2, 3, 0.1, 0),
        lambda m: m.decode_step_done(4, 2, 0.1, 3),  # more pad rows than free rows
        lambda m: m.decode_step_done(4, 2, float("nan"), 0),
        lambda m: m.warmup_progress(10, 9),
        lambda m: m.warmup_finished(-1.0),
        lambda m: m.set_load(-1, 0, 0),
        lambda m: m.request_rejected("busy"),
        lambda m: m.request_aborted("user"),
        lambda m: m.http_request("/v1/completions?stream=true", 200),  # a raw URL, not a template
        lambda m: m.http_request("v1/completions", 200),
        lambda m: m.http_request("/v1/completions", 99),
        lambda m: m.http_request("/v1/completions", "200"),
    ],
)
def test_out_of_range_calls_raise_and_change_nothing(call: object) -> None:
    m = make()
    before = samples(m)
    with pytest.raises(ValueError):
        call(m)  # type: ignore[operator]
    assert samples(m) == before


def test_mixed_steps_count_their_rows_padding_and_seconds() -> None:
    m = make(table=BucketTable(lengths=(64, 128), batch_sizes=(1, 4), context_length=384, mixed_tokens=(64, 128)))
    m.mixed_done(GraphKey("mixed", 4, 128), decode_rows=3, padding_tokens=20, seconds=0.15)
    m.mixed_done(GraphKey("mixed", 4, 64), decode_rows=4, padding_tokens=0, seconds=0.05)
    s = samples(m)
    assert val(s, "mixed_decode_rows_total") == 7
    assert val(s, "padding_tokens_total", phase="prefill") == 20
    assert val(s, "mixed_step_seconds_count") == 2
    assert math.isclose(val(s, "mixed_step_seconds_sum"), 0.2)
    assert val(s, "decode_step_seconds_count") == 0  # pure decode steps only
    for bad in ((GraphKey("mixed", 4, 64), 5, 0, 0.1), (GraphKey("mixed", 4, 64), 1, 64, 0.1)):
        with pytest.raises(ValueError):  # more rows than slots; no prompt token at all
            m.mixed_done(*bad)


def test_endpoint_label_values_are_capped() -> None:
    m = make(config=MetricsConfig(max_endpoints=2))
    m.http_request("/v1/completions", 200)
    m.http_request("/v1/chat/completions", 200)
    with pytest.raises(ValueError, match="max_endpoints"):
        m.http_request("/v1/completions/abc123", 200)
    m.http_request("/v1/completions", 500)  # a new status on a known route is fine
    s = samples(m)
    assert {dict(ls)["endpoint"] for ls in labelsets(s, "requests_total")} == {"/v1/completions", "/v1/chat/completions"}


def test_latency_edges_are_vllms_plus_two_seconds() -> None:
    vllm_ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
    vllm_tpot = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0]  # fmt: skip
    assert list(TTFT_BUCKETS) == sorted(vllm_ttft + [2.0])
    assert list(INTER_TOKEN_BUCKETS) == sorted(vllm_tpot + [2.0])
    assert 2.0 in REQUEST_DURATION_BUCKETS
    s = samples(make())
    assert edges(s, "time_to_first_token_seconds", bucket="64") == list(TTFT_BUCKETS)
    assert edges(s, "inter_token_latency_seconds") == list(INTER_TOKEN_BUCKETS)
    assert edges(s, "request_duration_seconds", bucket="256") == list(REQUEST_DURATION_BUCKETS)
    for name in ("queue_wait_seconds", "prefill_seconds", "decode_step_seconds"):
        assert 2.0 in edges(s, name)
    assert edges(s, "compile_seconds")[-1] == 3600.0
    assert edges(s, "batch_occupancy") == [i / 8 for i in range(1, 9)]


def test_latency_edges_are_configurable() -> None:
    custom = (0.05, 0.5, 2.0, 30.0)
    s = samples(make(latency_buckets=custom))
    for name, labels in [
        ("time_to_first_token_seconds", {"bucket": "128"}),
        ("inter_token_latency_seconds", {}),
        ("request_duration_seconds", {"bucket": "64"}),
        ("queue_wait_seconds", {}),
        ("prefill_seconds", {}),
        ("decode_step_seconds", {}),
    ]:
        assert edges(s, name, **labels) == list(custom)
    assert edges(s, "compile_seconds")[-1] == 3600.0  # not a latency histogram
    s = samples(make(config=MetricsConfig(ttft_buckets=[0.1, 2.0])))  # type: ignore[arg-type]
    assert edges(s, "time_to_first_token_seconds", bucket="64") == [0.1, 2.0]
    assert edges(s, "inter_token_latency_seconds") == list(INTER_TOKEN_BUCKETS)
    with pytest.raises(MetricsConfigError, match="not both"):
        make(latency_buckets=custom, config=MetricsConfig())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ttft_buckets", (1.0, 0.5), "strictly increasing"),
        ("ttft_buckets", (0.5, 0.5), "strictly increasing"),
        ("inter_token_buckets", (), "empty"),
        ("request_duration_buckets", (0.0, 1.0), "positive"),
        ("queue_wait_buckets", (-1.0, 1.0), "positive"),
        ("prefill_buckets", (1.0, math.inf), "finite"),
        ("decode_step_buckets", (math.nan,), "finite"),
        ("compile_buckets", (True, 2.0), "number"),
        ("occupancy_buckets", "0.5", "sequence"),
        ("max_endpoints", 0, "positive integer"),
    ],
)
def test_config_is_validated_with_the_field_named(field: str, value: object, message: str) -> None:
    with pytest.raises(MetricsConfigError, match=message) as err:
        MetricsConfig(**{field: value})  # type: ignore[arg-type]
    assert field in str(err.value)


def test_prompt_length_edges_cover_powers_halves_buckets_and_context() -> None:
    t = BucketTable(lengths=(64, 100, 256), batch_sizes=(1,), context_length=1000)
    e = prompt_length_edges(t)
    assert list(e) == sorted(set(e)) and e[-1] == 1000.0
    powers = [2.0**k for k in range(10)]  # 1 .. 512
    halves = [3.0 * 2**k for k in range(9)]  # 3, 6, .., 768: halfway between consecutive powers
    for edge in powers + halves + [100.0, 1000.0]:
        assert edge in e, edge
    assert all(x <= 1000 for x in e)
    m = make(table=t)
    assert edges(samples(m), "prompt_length") == list(e)
    m.request_admitted(100, 97)
    s = samples(m)
    assert val(s, "prompt_length_bucket", le="96.0") == 0
    assert val(s, "prompt_length_bucket", le="100.0") == 1


def test_info_carries_runtime_facts_and_the_table() -> None:
    s = samples(Metrics(CollectorRegistry(), table(), info={**INFO, "version": "1.2.3"}))
    (labels,) = labelsets(s, "info")
    assert dict(labels) == {
        **INFO,
        "version": "1.2.3",
        "lengths": "64,128,256",
        "batch_sizes": "1,2,4",
        "prefill_batch_sizes": "1,2",
        "kv_lengths": "256,384",
        "context_length": "384",
    }
    assert val(s, "info", **dict(labels)) == 1
    (labels,) = labelsets(samples(make()), "info")
    assert dict(labels)["version"]  # from the package metadata, or "unknown" in a source checkout
    with pytest.raises(ValueError, match="compile_backend"):
        Metrics(CollectorRegistry(), table(), info={"model": "m", "dtype": "float32", "device": "cpu"})
    with pytest.raises(ValueError, match="bucket table"):
        Metrics(CollectorRegistry(), table(), info={**INFO, "lengths": "1,2"})


def test_metrics_live_on_the_given_registry_only() -> None:
    before = {name for name in REGISTRY._names_to_collectors}
    a, b = make(), make()  # two instances never clash: each has its own registry
    a.request_over_limit()
    assert val(samples(a), "requests_over_limit_total") == 1
    assert val(samples(b), "requests_over_limit_total") == 0
    assert {name for name in REGISTRY._names_to_collectors} == before
    assert not any(name.startswith(P) for name in REGISTRY._names_to_collectors)


def test_render_returns_exposition_text_and_its_content_type() -> None:
    m = make()
    m.set_ready(True)
    body, content_type = m.render()
    assert content_type == CONTENT_TYPE_LATEST
    assert isinstance(body, bytes)
    assert b"\nbucketserve_ready 1.0\n" in body
    m.set_ready(False)
    assert b"\nbucketserve_ready 0.0\n" in m.render()[0]
