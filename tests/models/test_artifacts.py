"""Compiled graphs saved as files and loaded on restart: sound artifacts load, bad ones are reported and rebuilt.

The real inductor path (C++ builds), on a three-graph table: one module-scoped cold build, then restarts.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from buckets import BucketTable, GraphKey
from models import prepack
from models.artifacts import GraphStore, aot_available, label_of
from models.compile import CompileAccountant, CompileSettings, RecompileError
from models.generator import generate_one
from models.graph_builder import BuildSpec, ProcessBuilder
from models.loading import load_model
from models.runner import ModelRunner
from models.sampling import SamplingParams
from tests.support.tiny import build_tiny_checkpoint

# decode[b1_kv16], prefill[b1_l8], sample[b1]
TABLE = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=16, kv_lengths=(16,))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [7, 42, 99, 123, 5]


def _runner(path: str, cache: Path, accountant: CompileAccountant | None = None) -> ModelRunner:
    torch.set_num_threads(1)  # part of the artifacts' guards, like the cache key's thread count
    model = load_model(path, "float32", "cpu")
    return ModelRunner(model, TABLE, CompileSettings(backend="inductor", cache_dir=str(cache)), accountant)


def _eager(path: str) -> list[int]:
    model = load_model(path, "float32", "cpu")
    return generate_one(ModelRunner(model, TABLE, CompileSettings(backend="eager")), PROMPT, GREEDY, 8).token_ids


@pytest.fixture(scope="module")
def built(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory filled by one cold warm-up."""
    cache = tmp_path_factory.mktemp("graphs-cache")
    runner = _runner(tiny_llama, cache)
    runner.warmup()
    assert [r.cache_hit for r in runner.accountant.records] == [False] * TABLE.num_graphs
    assert generate_one(runner, PROMPT, GREEDY, 8).token_ids == _eager(tiny_llama)
    runner.stop_serving()
    return cache


def _copy(built: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    return cache


def test_restart_loads_every_graph_and_weights_stay_inputs(built: Path, tiny_llama: str, tmp_path: Path) -> None:
    """Another model of the same shapes (other weights) runs on the same artifacts and gives its own eager
    answer: the artifacts hold code, not weights."""
    other = build_tiny_checkpoint(tmp_path / "other", seed=7)
    runner = _runner(other, _copy(built, tmp_path))
    runner.warmup()
    assert [r.cache_hit for r in runner.accountant.records] == [True] * TABLE.num_graphs
    got = generate_one(runner, PROMPT, GREEDY, 8).token_ids
    assert got == _eager(other) and got != _eager(tiny_llama)


def test_unwarmed_graph_is_refused_not_compiled_after_warmup(built: Path, tiny_llama: str, tmp_path: Path) -> None:
    runner = _runner(tiny_llama, _copy(built, tmp_path))
    runner.warmup([GraphKey("decode", 1, 16), GraphKey("prefill", 1, 8)])
    with pytest.raises(RecompileError):
        runner.sample(torch.zeros(1, runner.vocab_size), [None])
    assert runner.accountant.count() == 2


@pytest.mark.parametrize("damage,reason", [
    ("flip", "corrupt: checksum mismatch"),
    ("truncate", "corrupt: "),
    ("torch", "stale: built by torch 0.0"),
    ("swap", "stale: does not load"),
])
def test_bad_artifact_is_reported_and_rebuilt(built: Path, tiny_llama: str, tmp_path: Path, damage: str,
                                              reason: str) -> None:
    cache = _copy(built, tmp_path)
    key = GraphKey("sample", 1, 0)  # the cheapest graph to rebuild
    blob = cache / "graphs" / f"{label_of(key)}.bin"
    meta = blob.with_suffix(".json")
    data = bytearray(blob.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    elif damage == "truncate":
        blob.write_bytes(bytes(data[:100]))
    elif damage == "torch":
        meta.write_text(json.dumps(dict(json.loads(meta.read_text()), torch="0.0")))
    else:  # a well-formed file whose content does not deserialize, with a sidecar that vouches for it
        import hashlib

        junk = b"not a compiled function"
        blob.write_bytes(junk)
        meta.write_text(json.dumps(dict(json.loads(meta.read_text()), sha256=hashlib.sha256(junk).hexdigest(),
                                        bytes=len(junk))))
    rejected: list[tuple[object, str]] = []
    runner = _runner(tiny_llama, cache, CompileAccountant(on_rejected=lambda k, r: rejected.append((k, r))))
    runner.warmup()
    assert len(rejected) == 1 and rejected[0][0] == key and rejected[0][1].startswith(reason), rejected
    hits = {r.key: r.cache_hit for r in runner.accountant.records}
    assert hits == {key: False, GraphKey("prefill", 1, 8): True, GraphKey("decode", 1, 16): True}
    assert generate_one(runner, PROMPT, GREEDY, 8).token_ids == _eager(tiny_llama)
    assert GraphStore(str(cache / "graphs")).load(key, runner.graphs.fingerprint).fn is not None  # rebuilt, saved again


def test_artifact_from_another_thread_count_is_stale(built: Path, tiny_llama: str, tmp_path: Path) -> None:
    cache = _copy(built, tmp_path)
    rejected: list[str] = []
    runner = _runner(tiny_llama, cache, CompileAccountant(on_rejected=lambda k, r: rejected.append(r)))
    torch.set_num_threads(2)
    try:
        runner.warmup([GraphKey("sample", 1, 0)])
    finally:
        torch.set_num_threads(1)
    assert rejected == ["stale: its guards do not match this model or cache"]


def test_builder_process_compiles_part_of_a_cold_table(tiny_llama: str, tmp_path: Path) -> None:
    """Two processes share a cold warm-up; every graph is counted once, as a miss, with its compile time."""
    cache = tmp_path / "cache"
    runner = _runner(tiny_llama, cache)
    spec = BuildSpec(tiny_llama, "float32", "cpu", TABLE, runner.settings, 1)
    with ProcessBuilder(spec, 1) as builder:
        runner.warmup(builder=builder)
    records = runner.accountant.records
    assert sorted(str(r.key) for r in records) == sorted(str(k) for k in TABLE.graph_keys())
    assert all(r.cache_hit is False and r.seconds > 0.5 for r in records)  # a load takes milliseconds
    ids = random.Random(3).choices(range(5, 400), k=5)
    assert generate_one(runner, ids, GREEDY, 8).token_ids == generate_one(
        ModelRunner(load_model(tiny_llama, "float32", "cpu"), TABLE, CompileSettings(backend="eager")),
        ids, GREEDY, 8).token_ids


def test_abandoned_builder_is_stopped_mid_build(tiny_llama: str, tmp_path: Path) -> None:
    """A warm-up that fails (or a shutdown during it) stops its builder processes instead of waiting them out."""
    settings = CompileSettings(backend="inductor", cache_dir=str(tmp_path / "cache"))
    builder = ProcessBuilder(BuildSpec(tiny_llama, "float32", "cpu", TABLE, settings, 1), 1)
    future = builder.submit(list(TABLE.graph_keys()))
    procs = list(builder._pool._processes.values())  # type: ignore[union-attr]
    assert procs and all(p.is_alive() for p in procs)
    builder.close(abandon=True)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(Exception):
        future.result(timeout=5)


def test_artifacts_of_another_model_are_stale(built: Path, tmp_path: Path) -> None:
    """Parameters are not guarded one by one (too slow to load); their names, shapes and dtypes are checked
    as one fingerprint: a model of another architecture never runs on these graphs."""
    qwen = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2")
    rejected: list[str] = []
    runner = _runner(qwen, _copy(built, tmp_path), CompileAccountant(on_rejected=lambda k, r: rejected.append(r)))
    runner.warmup([GraphKey("sample", 1, 0)])
    assert rejected == ["stale: built for weights of other names, shapes or dtypes"]


def test_cancelled_warmup_stops_between_graphs(tiny_llama: str) -> None:
    from models.runner import WarmupCancelled

    runner = ModelRunner(load_model(tiny_llama, "float32", "cpu"), TABLE, CompileSettings(backend="dynamo-eager"))
    asked: list[int] = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 1

    with pytest.raises(WarmupCancelled, match="after 1 of 3 graphs"):
        runner.warmup(cancelled=cancelled)
    assert runner.accountant.count() == 1 and not runner.is_serving


def test_builders_die_with_a_killed_parent(tiny_llama: str, tmp_path: Path) -> None:
    """SIGKILL of the serving process (no chance to stop its builders) takes the builders with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from buckets import BucketTable\n"
        "from models.compile import CompileSettings\n"
        "from models.graph_builder import BuildSpec, ProcessBuilder\n"
        "if __name__ == '__main__':\n"
        f"    t = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=16, kv_lengths=(16,))\n"
        f"    b = ProcessBuilder(BuildSpec({tiny_llama!r}, 'float32', 'cpu', t, "
        f"CompileSettings(backend='inductor', cache_dir={str(tmp_path)!r}), 1), 1)\n"
        "    b.submit(list(t.graph_keys()))\n"
        "    print(*[p.pid for p in b._pool._processes.values()], flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]  # type: ignore[union-attr]
        assert pids
        deadline = time.monotonic() + 120
        while not any(files for _, _, files in os.walk(tmp_path)):  # the builder is compiling: set up and running
            assert time.monotonic() < deadline
            time.sleep(0.2)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{p}") and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]
                  for p in pids):
            assert time.monotonic() < deadline, "a builder outlived its killed parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)
        if parent.stdout is not None:
            parent.stdout.close()  # no ResourceWarning (warnings are errors)


@pytest.mark.skipif(not prepack.supported(torch.bfloat16, "cpu"), reason="needs oneDNN's bf16 on this CPU")
def test_bfloat16_graphs_with_prepacked_linears_save_and_load(tiny_llama: str, tmp_path: Path) -> None:
    """bf16 graphs call the prepacked-linear and attention ops (outside the graph, registered on import):
    they save, load in a restart and give the cold run's tokens."""
    torch.set_num_threads(1)
    outputs = []
    for run in ("cold", "restart"):
        settings = CompileSettings(backend="inductor", cache_dir=str(tmp_path / "cache"))
        runner = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), TABLE, settings)
        assert runner.prepacked > 0
        runner.warmup()
        assert [r.cache_hit for r in runner.accountant.records] == [run == "restart"] * TABLE.num_graphs
        outputs.append(generate_one(runner, PROMPT, GREEDY, 8).token_ids)
        assert runner.accountant.count("serving") == 0
        runner.stop_serving()
    assert outputs[0] == outputs[1]


def test_torch_without_ahead_of_time_compile_compiles_in_process(tiny_llama: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An older torch (no `aot_compile`: the torch 2.11 of a GPU image) still serves inductor graphs: compiled
    in this process through torch.compile, nothing saved, fail-closed after warm-up as ever."""
    monkeypatch.setattr("models.graph_set.aot_available", lambda: False)
    torch.set_num_threads(1)
    runner = _runner(tiny_llama, tmp_path / "cache")
    assert not runner.graphs.aot and runner.graphs.store is None
    runner.warmup()
    assert runner.accountant.count("warmup") == TABLE.num_graphs
    assert generate_one(runner, PROMPT, GREEDY, 8).token_ids == _eager(tiny_llama)
    assert runner.accountant.count("serving") == 0
    assert not (tmp_path / "cache" / "graphs").exists()
    runner.stop_serving()


def test_aot_available_on_the_pinned_torch() -> None:
    assert aot_available()
