"""Operations against real server processes: graceful drain on SIGTERM, JSON request logs, the persistent
compile cache across processes, precompile."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from server.compose import build_model
from tests.support.process import TINY_FLAGS, ServerProcess
from tests.support.tiny import tiny_settings


def stream_completion(url: str, max_tokens: int, out: list) -> None:
    body = {"prompt": "the cat sat on the mat", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    chunks, finish = 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                chunks += 1
                finish = choice["finish_reason"] or finish
    out.append((chunks, finish))


def streams_admitted(server: ServerProcess, count: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    """`count` streaming completions started, returned once the server has admitted all of them (their results
    land in the list as each ends)."""
    results: list = []
    threads = [threading.Thread(target=stream_completion, args=(server.url, max_tokens, results))
               for _ in range(count)]
    for t in threads:
        t.start()
    while server.metric("bucketserve_bucket_requests_total") < count:
        time.sleep(0.005)
    return results, threads


def draining(server: ServerProcess, timeout: float = 10.0) -> httpx.Response:
    """/ready's answer once it reports the drain (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        ready = httpx.get(server.url + "/ready")
        if ready.status_code == 503 and ready.json().get("draining") or time.monotonic() > deadline:
            return ready
        time.sleep(0.005)


def test_sigterm_drains_in_flight_streams_refuses_new_and_exits_zero(tiny_llama: str, tmp_path: Path) -> None:
    server = ServerProcess(tiny_llama, *TINY_FLAGS, "--compile-backend", "eager", "--log-format", "json",
                           "--drain-timeout", "60", log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        # SIGTERM once all 8 are admitted (a request that arrives after it is refused, by design).
        results, threads = streams_admitted(server, 8, 120)
        server.proc.send_signal(signal.SIGTERM)
        # /ready reports the drain as soon as the signal is handled; the request right after it must be refused. (A
        # fixed pause raced the drain: 8 streams of the tiny model can finish in less than 0.2 s.)
        ready = draining(server)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        for t in threads:
            t.join(120)
        code = server.proc.wait(60)
    finally:
        server.stop()
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert refused.json()["error"]["code"] == "draining"
    assert ready.status_code == 503 and ready.json()["draining"] is True
    assert len(results) == 8 and all(finish == "length" for _, finish in results), results
    assert code == 0
    # One JSON line per request at completion, with its facts and without the prompt text.
    lines = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines() if line.startswith("{")]
    requests = [r for r in lines if r.get("logger") == "bucketserve.requests"]
    assert len(requests) == 8
    for r in requests:
        assert r["bucket"] == 8 and r["output_tokens"] == 120 and r["status"] == "length"
        assert r["ttft_s"] > 0 and r["duration_s"] >= r["ttft_s"] and "prompt" not in r
    assert any(r["message"].startswith("warm-up 1/") for r in lines)


def test_a_second_sigterm_ends_every_stream_with_a_final_event_and_shuts_down_cleanly(tiny_llama: str,
                                                                                       tmp_path: Path) -> None:
    """The second signal cuts a 60 s drain short. It used to be uvicorn's forced exit: each stream was cut
    mid-body (a truncated chunked response), the log held a CancelledError traceback per request, and the app's
    shutdown (which stops the engine thread) never ran."""
    log = tmp_path / "server.log"
    server = ServerProcess(tiny_llama, *TINY_FLAGS, "--max-model-len", "512", "--compile-backend", "eager",
                           "--drain-timeout", "60", log_path=log)
    try:
        server.wait_ready()
        results, threads = streams_admitted(server, 4, 480)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # the second signal once the first is handled (not after a fixed pause, which the tiny model's streams
        # could outrun): it cuts the drain short
        draining(server)
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        seconds = time.monotonic() - started
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    text = log.read_text()
    assert code == 0 and seconds < 10  # not the 60 s drain
    assert len(results) == 4 and all(finish == "abort" and 0 < chunks < 480 for chunks, finish in results), results
    assert "Traceback" not in text and "CancelledError" not in text
    assert "cutting the drain short" in text and "Application shutdown complete" in text


def test_compile_cache_key_changes_with_dtype_buckets_and_model(tiny_llama: str, tmp_path: Path) -> None:
    base = tiny_settings(compile_backend="inductor", compile_cache_dir=str(tmp_path))
    key = build_model(base, tiny_llama).compile_cache_dir()
    assert key.startswith(str(tmp_path)) and key == build_model(base, tiny_llama).compile_cache_dir()
    for changed in (replace(base, dtype="bfloat16"), replace(base, buckets=(8, 16, 64)),
                    replace(base, compile_backend="dynamo-eager"), replace(base, max_model_len=96, kv_buckets=(32,)),
                    replace(base, kv_buckets=(64,)), replace(base, weight_prepack=False),
                    replace(base, mixed_steps=False)):
        assert build_model(changed, tiny_llama).compile_cache_dir() != key


def test_compile_cache_key_changes_with_the_graph_code(tiny_llama: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucketserve whose models/ code differs (it may trace other graphs) does not load the old artifacts."""
    import models.compile

    base = tiny_settings(compile_backend="inductor", compile_cache_dir=str(tmp_path))
    key = build_model(base, tiny_llama).compile_cache_dir()
    assert len(models.compile.graph_code_digest()) == 16
    monkeypatch.setattr(models.compile, "graph_code_digest", lambda: "another-version")
    assert build_model(base, tiny_llama).compile_cache_dir() != key


def test_second_process_loads_every_graph_from_the_cache(tiny_llama: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    flags = ["--buckets", "16", "--batch-sizes", "1", "--prefill-batch-sizes", "1", "--max-model-len", "32",
             "--num-threads", "1", "--compile-backend", "inductor", "--compile-cache-dir", cache]
    pre = subprocess.run([sys.executable, "-m", "server.cli", "precompile", "--model", tiny_llama, *flags],
                         capture_output=True, text=True, timeout=900)
    assert pre.returncode == 0, pre.stderr[-3000:]
    manifest = json.loads(pre.stdout[pre.stdout.index("{"):])
    # sample, decode, prefill, mixed (prompt tokens riding in decode steps; 32: a solo step, nothing decoding),
    # verify (speculative decoding's mixed steps, and 8 tokens for a row and its drafts)
    assert sorted((g["graph"], g["bucket"]) for g in manifest["graphs"]) == [
        ("decode", "b1_kv32"), ("mixed", "t16"), ("mixed", "t32"), ("prefill", "b1_l16"), ("sample", "b1"),
        ("verify", "t16"), ("verify", "t32"), ("verify", "t8")]
    server = ServerProcess(tiny_llama, *flags, "--require-cached-graphs", log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        assert server.metric("bucketserve_compile_cache_hits_total") == 8
        assert server.metric("bucketserve_compile_cache_misses_total") == 0
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 3})
        assert r.status_code == 200
        assert server.metric("bucketserve_recompilations_total") == 0
    finally:
        assert server.stop() == 0
    log = (tmp_path / "server.log").read_text()
    assert "(from cache)" in log and "8 of 8 graphs loaded from the cache" in log


def test_require_cached_graphs_refuses_readiness_when_the_cache_is_cold(tiny_llama: str, tmp_path: Path) -> None:
    server = ServerProcess(tiny_llama, *TINY_FLAGS, "--compile-backend", "dynamo-eager", "--compile-cache-dir",
                           str(tmp_path / "empty"), "--require-cached-graphs", log_path=tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 300
        while True:
            ready = httpx.get(server.url + "/ready", timeout=5) if _up(server) else None
            if ready is not None and ready.json().get("failed"):
                break
            assert time.monotonic() < deadline and server.proc.poll() is None
            time.sleep(0.2)
        assert ready.status_code == 503 and "not in the compile cache" in ready.json()["failed"]
        assert httpx.get(server.url + "/health").status_code == 200  # alive, just never ready
    finally:
        assert server.stop() == 0


def _up(server: ServerProcess) -> bool:
    try:
        httpx.get(server.url + "/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


def test_require_cached_graphs_fails_before_compiling_anything(tiny_llama: str, tmp_path: Path) -> None:
    """Inductor keeps one artifact per graph: a missing one is known before any compile starts."""
    from server.engine.model import CacheMissingError

    settings = tiny_settings(compile_backend="inductor", compile_cache_dir=str(tmp_path), require_cached_graphs=True)
    model = build_model(settings, tiny_llama)
    with pytest.raises(CacheMissingError, match=f"{model.table.num_graphs} graphs were not in the compile cache"):
        model.load_and_warm()
    assert model.accountant.count() == 0


@pytest.mark.parametrize(("free_gib", "builders"), [(64, 1), (1, 0)])
def test_cold_start_starts_only_the_builders_memory_allows(tiny_llama: str, tmp_path: Path, free_gib: int,
                                                           builders: int, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Each builder process holds what the server holds (weights, KV cache, packed copies): a cold start asks for
    `--compile-workers` - 1 of them, and starts only as many as leave MEMORY_RESERVE of the available memory free
    (a container's limit counts every process in it), with a warning when it starts fewer."""
    import models.graph_builder as graph_builder
    from models.runner import ModelRunner

    monkeypatch.setattr(graph_builder, "available_memory", lambda: free_gib << 30)
    monkeypatch.setattr(graph_builder, "resident_memory", lambda: 1 << 30)
    seen: list[int] = []

    def warmup(self: ModelRunner, keys: object = None, *, builder: graph_builder.ProcessBuilder, **_: object) -> float:
        seen.append(builder.workers)  # the compiles themselves are the artifact tests' subject
        return 0.0

    monkeypatch.setattr(ModelRunner, "warmup", warmup)
    settings = tiny_settings(compile_backend="inductor", compile_cache_dir=str(tmp_path), compile_workers=2)
    with caplog.at_level("WARNING", logger="models.graph_builder"):
        build_model(settings, tiny_llama).load_and_warm()
    assert seen == [builders]
    assert ("0 of 1 graph builder processes" in caplog.text) == (builders == 0)


@pytest.mark.slow
def test_sigterm_during_a_cold_start_stops_the_warmup_and_its_builders(tiny_llama: str, tmp_path: Path) -> None:
    """A pod deleted while it compiles: the server exits 0 after at most the graph in progress, and the
    builder process compiling the other half goes with it."""
    server = ServerProcess(tiny_llama, *TINY_FLAGS, "--compile-backend", "inductor", "--compile-workers", "2",
                           "--compile-cache-dir", str(tmp_path / "cache"), log_path=tmp_path / "server.log")
    deadline = time.monotonic() + 300
    while "builder processes" not in (tmp_path / "server.log").read_text():
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.2)
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    assert server.stop() == 0

    def alive() -> list[str]:
        running = []
        for pid in children:
            try:
                if "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
                    running.append(pid)
            except FileNotFoundError:  # gone (also between a check and the read)
                pass
        return running

    # A child that only notices its parent's exit (multiprocessing's resource tracker reads a pipe that closes
    # then) may take a moment to go: gone within seconds, not at once.
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), alive()
    assert "exiting during warm-up" in (tmp_path / "server.log").read_text()
