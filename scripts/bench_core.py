"""Single-stream engine benchmark on the default model: warm-up seconds per graph, prefill ms per bucket and
decode tokens/s for eager vs inductor vs inductor+freezing, in float32 and bfloat16, side by side.

Each configuration runs in its own subprocess (compiler settings are process-wide) with a cold inductor
cache. Writes results/bench-core.json and .md. Usage: python scripts/bench_core.py [--lengths 64,256,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [(d, b, f) for d in ("float32", "bfloat16") for (b, f) in
           (("eager", False), ("inductor", False), ("inductor", True))]


def run_one(dtype: str, backend: str, freezing: bool, lengths: tuple[int, ...], steps: int) -> dict:
    import torch

    from buckets import BucketTable
    from models.compile import CompileSettings
    from models.loading import load_model, resolve_model_path
    from models.runner import ModelRunner, PrefillRow

    torch.manual_seed(0)
    model = load_model(resolve_model_path("default"), dtype, "cpu")
    table = BucketTable(lengths=lengths, batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=2048)
    runner = ModelRunner(model, table, CompileSettings(backend=backend, inductor_freezing=freezing))
    per_graph: dict[str, float] = {}
    total = runner.warmup(progress=lambda k, s, d, n: per_graph.__setitem__(str(k), round(s, 2)))
    prefill_ms = {}
    for length in lengths:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            runner.prefill([PrefillRow(0, list(range(100, 100 + length)))], length, 1)
            times.append((time.perf_counter() - t0) * 1000)
        prefill_ms[length] = round(statistics.median(times), 1)
    tokens = torch.zeros(1, dtype=torch.long)
    pos = torch.zeros(1, dtype=torch.long)
    times = []
    for i in range(steps):
        tokens[0], pos[0] = 100 + i, 64 + i
        t0 = time.perf_counter()
        runner.decode(1, tokens, pos)
        times.append(time.perf_counter() - t0)
    return {"dtype": dtype, "backend": backend + ("+freezing" if freezing else ""), "warmup_seconds": round(total, 1),
            "graph_seconds": per_graph, "prefill_ms": prefill_ms,
            "decode_tokens_per_s": round(1 / statistics.median(times), 1),
            "serving_compilations": runner.accountant.count("serving")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", default="results")
    parser.add_argument("--one", default="")
    args = parser.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if args.one:
        dtype, backend, freezing = args.one.split(":")
        print(json.dumps(run_one(dtype, backend, freezing == "1", lengths, args.steps)))
        return 0
    results = []
    for dtype, backend, freezing in CONFIGS:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            proc = subprocess.run([sys.executable, __file__, "--one", f"{dtype}:{backend}:{int(freezing)}",
                                   "--lengths", args.lengths, "--steps", str(args.steps)],
                                  capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            results.append({"dtype": dtype, "backend": backend, "error": proc.stderr[-2000:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-core.json").write_text(json.dumps(results, indent=2))
    lines = ["| dtype | backend | warm-up s | " + " | ".join(f"prefill {n} ms" for n in lengths)
             + " | decode tok/s |", "|---" * (4 + len(lengths)) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['dtype']} | {r['backend']} | error | " + " | " * len(lengths))
            continue
        lines.append(f"| {r['dtype']} | {r['backend']} | {r['warmup_seconds']} | "
                     + " | ".join(str(r["prefill_ms"][str(n)] if str(n) in r["prefill_ms"] else r["prefill_ms"][n])
                                  for n in lengths) + f" | {r['decode_tokens_per_s']} |")
    (out / "bench-core.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
