"""The bench against a fake OpenAI streaming server: SSE timing, fallbacks, failures, and a full run."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cli import main
from bench.client import ApiMode
from bench.loadgen import run_level_sync, send_one
from bench.prompts import Prompt
from bench.runner import RunOptions, probe_mode
from bench.servers import free_port
from tests.bench.fake_openai import FIRST_DELAY, MODEL, SLOW_DELAY, FakeServer, header_bucket, running_fake_server


def _prompt(n_prompt: int = 40, n_out: int = 6) -> Prompt:
    return Prompt(0, " ".join(f"w{i}" for i in range(n_prompt)), tuple(range(n_prompt)), n_out, n_prompt)


def test_stream_timing_and_token_counts(fake_server: FakeServer) -> None:
    res = send_one(fake_server.url + "/slow", _prompt(40, 6), ApiMode(model=MODEL))
    assert res.ok and res.error is None and res.status == 200
    assert res.output_tokens == 6 and len(res.token_times) == 6
    assert res.finish_reason == "length"
    assert res.bucket == header_bucket(40) == 100  # from x-bucket, not the power-of-two fallback
    assert res.ttft is not None and res.e2e is not None
    assert FIRST_DELAY * 0.9 <= res.ttft <= res.e2e
    gaps = [b - a for a, b in zip(res.token_times, res.token_times[1:])]
    # chunks are timed one by one as they arrive (allowing a scheduling hiccup or two on a busy machine)
    assert all(g >= 0 for g in gaps) and sum(g >= SLOW_DELAY / 2 for g in gaps) >= 3
    sent = fake_server.state.requests[-1]
    assert sent["prompt"] == list(range(40)) and sent["ignore_eos"] is True and sent["max_tokens"] == 6


def test_chat_endpoint_counts_content_chunks(fake_server: FakeServer) -> None:
    res = send_one(fake_server.url, _prompt(5, 4), ApiMode(endpoint="chat", prompt_format="text", model=MODEL))
    assert res.ok and res.output_tokens == 4 and len(res.token_times) == 4  # the role-only chunk is no token
    sent = fake_server.state.requests[-1]
    assert sent["path"] == "/v1/chat/completions" and sent["messages"][0]["content"] == _prompt(5, 4).text


def test_failures_are_classified(fake_server: FakeServer) -> None:
    res = send_one(fake_server.url + "/fail", _prompt(), ApiMode(model=MODEL))
    assert not res.ok and res.error == "http_503" and "overloaded" in res.detail
    closed = f"http://127.0.0.1:{free_port()}"
    res = send_one(closed, _prompt(), ApiMode(model=MODEL), timeout=5)
    assert not res.ok and res.error == "connection_error"
    res = send_one(fake_server.url, _prompt(), ApiMode(model="other"))
    assert res.error == "http_404"


def test_probe_falls_back_to_text_and_generation_config(fake_server: FakeServer) -> None:
    opts = RunOptions(concurrency=(1,))
    mode, first, notes = probe_mode(fake_server.url + "/strict", _prompt(12, 5), opts, MODEL)
    assert first.ok
    assert (mode.prompt_format, mode.eos) == ("text", "generation_config")
    assert len(notes) == 2
    # no usage, no x-bucket, no [DONE]: tokens counted from chunks, bucket from the prompt length
    assert first.output_tokens == 5 and first.bucket == 16
    last = fake_server.state.requests[-1]
    assert json.loads(last["generation_config"])["min_new_tokens"] == 5


def test_closed_loop_level(fake_server: FakeServer) -> None:
    prompts = [Prompt(i, "x", tuple(range(10 + i)), 3, 10 + i) for i in range(7)]
    run = run_level_sync(fake_server.url, prompts, ApiMode(model=MODEL), 3)
    assert run.issued_all and [r.index for r in run.results] == list(range(7))
    assert all(r.ok for r in run.results) and run.wall_seconds > 0


def test_full_run_writes_consistent_reports(fake_server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = main([
        "--url", fake_server.url, "--num-requests", "10", "--concurrency", "1,3",
        "--prompt-len", "uniform:5..300", "--output-len", "fixed:4", "--out", str(out),
    ])
    assert rc == 0
    doc = json.loads((out / "result.json").read_text())
    (target,) = doc["targets"]
    assert target["error"] is None and target["is_bucketserve"]
    assert target["startup"]["warmup_seconds_metric"] == 1.5
    assert target["recompilations"] == 0.0
    assert target["api"] == {"endpoint": "completions", "prompt_format": "ids", "eos": "ignore_eos", "model": MODEL}
    assert [lv["concurrency"] for lv in target["levels"]] == [1, 3]
    for lv in target["levels"]:
        assert (lv["requests"], lv["completed"], lv["failed"], lv["failures"]) == (10, 10, 0, {})
        assert lv["output_tokens"] == 40
        assert sum(b["requests"] for b in lv["per_bucket"].values()) == 10
        records = lv["request_records"]
        assert all(header_bucket(r["prompt_tokens"]) == r["bucket"] for r in records)
        assert {str(r["bucket"]) for r in records} == set(lv["per_bucket"])
    # every request of the workload hit its planned prompt length exactly (ids sent)
    sent = [r for r in fake_server.state.requests if isinstance(r.get("prompt"), list)]
    assert len(sent) == 1 + 2 * 10  # probe + two levels
    assert all(5 <= len(r["prompt"]) <= 300 for r in sent)
    md = (out / "summary.md").read_text()
    assert "## Steady state" in md and "| 10 / 10 |" in md and "warm-up" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 3 and pngs[0].startswith("latency_cdf_")
    assert pngs[1:] == ["throughput_vs_concurrency.png", "ttft_vs_concurrency.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in out.glob("*.png"))


def test_run_against_a_dead_url_reports_failure(tmp_path: Path) -> None:
    rc = main(["--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "2", "--concurrency", "1",
               "--out", str(tmp_path), "--no-plots"])
    assert rc == 1
    doc = json.loads((tmp_path / "result.json").read_text())
    assert "cannot reach" in doc["targets"][0]["error"]  # a dead server, not one without /tokenize


def test_replicas_share_the_clients_of_a_level() -> None:
    """Data parallel: with two URLs, clients alternate between them and each replica serves its share."""
    with running_fake_server() as first, running_fake_server() as second:
        prompts = [Prompt(i, f"w{i}", (5, 6, 7), 3, 3) for i in range(8)]
        run = run_level_sync([first.url, second.url], prompts, ApiMode(model=MODEL), 2)
        assert all(r.ok for r in run.results) and len(run.results) == 8
        served = (len(first.state.requests), len(second.state.requests))
        assert sum(served) == 8 and min(served) >= 2, served
