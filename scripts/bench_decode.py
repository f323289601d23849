"""Decode step cost by (batch bucket, KV bucket) on the default model, one compute thread: the evidence behind
the default KV and batch buckets, and the before/after of KV-length buckets (KV = context length is what every
step cost before them). Rows sit at position `--position` (a typical live length); median of `--steps` steps.

`--busy N`: only the first N rows of each batch decode, the others are free slots (position -1, as the engine
sends them: zeroed rows the CPU kernels skip): what a batch bucket costs while fewer clients than its rows run.

Each configuration runs in its own subprocess (compiler settings are process-wide).
Usage: python scripts/bench_decode.py [--batches 1,8,16] [--kv 256,1024,2048] [--configs float32,bfloat16:freeze]
    [--busy N]
A config is a dtype with an optional `:freeze` (inductor freezing) or `:plain` (no weight prepacking).
Writes results/bench-decode.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_one(dtype: str, freezing: bool, prepack: bool, batches: tuple[int, ...], kvs: tuple[int, ...], position: int,
            steps: int, threads: int, busy: int = 0) -> dict:
    import torch

    from buckets import BucketTable, GraphKey
    from models.compile import CompileSettings
    from models.loading import load_model, resolve_model_path
    from models.runner import ModelRunner

    torch.set_num_threads(threads)
    model = load_model(resolve_model_path("default"), dtype, "cpu")
    table = BucketTable(lengths=(64,), batch_sizes=batches, prefill_batch_sizes=(1,), context_length=kvs[-1],
                        kv_lengths=kvs)
    runner = ModelRunner(model, table, CompileSettings(backend="inductor", inductor_freezing=freezing,
                                                                  weight_prepack=prepack))
    compile_s: dict[str, float] = {}
    runner.warmup([GraphKey("decode", b, kv) for b in batches for kv in kvs],
                  progress=lambda k, s, d, n: compile_s.__setitem__(k.bucket, round(s, 1)))
    step_ms: dict[str, float] = {}
    for b in batches:
        tokens = 100 + 37 * torch.arange(b)  # distinct: the linears run a repeat of the row before only once
        pos = torch.full((b,), position, dtype=torch.long)
        if busy:
            tokens[busy:], pos[busy:] = 0, -1  # free slots
        for kv in kvs:
            times = []
            for i in range(steps + 3):
                t0 = time.perf_counter()
                runner.decode(b, tokens, pos, kv)
                if i >= 3:
                    times.append((time.perf_counter() - t0) * 1000)
            step_ms[f"b{b}_kv{kv}"] = round(statistics.median(times), 1)
    return {"dtype": dtype, "freezing": freezing, "prepacked": runner.prepacked, "threads": threads, "position": position,
            "busy": busy or "all",
            "compile_s": compile_s, "step_ms": step_ms, "serving_compilations": runner.accountant.count("serving")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--kv", default="256,1024,2048")
    parser.add_argument("--configs", default="float32,bfloat16:freeze")
    parser.add_argument("--position", type=int, default=150)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results")
    parser.add_argument("--busy", type=int, default=0, help="rows of each batch that decode (0: all)")
    parser.add_argument("--one", default="")
    args = parser.parse_args()
    batches = tuple(int(x) for x in args.batches.split(","))
    kvs = tuple(int(x) for x in args.kv.split(","))
    if args.one:
        dtype, _, option = args.one.partition(":")
        result = run_one(dtype, option == "freeze", option != "plain", batches, kvs, args.position, args.steps,
                         args.threads, args.busy)
        print(json.dumps(result))
        return 0
    results = []
    for config in args.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--batches", args.batches, "--kv", args.kv,
                               "--position", str(args.position), "--steps", str(args.steps),
                               "--threads", str(args.threads), "--busy", str(args.busy)],
                              capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-decode.json").write_text(json.dumps(results, indent=2))
    lines = ["| config | batch | " + " | ".join(f"KV {kv} ms" for kv in kvs) + " | tok/s at smallest KV |",
             "|---" * (3 + len(kvs)) + "|"]
    for r in results:
        name = r["dtype"] + (" + freezing" if r["freezing"] else "") + (" + prepacked" if r["prepacked"] else "")
        for b in batches:
            ms = [r["step_ms"][f"b{b}_kv{kv}"] for kv in kvs]
            rows = min(b, args.busy) if args.busy else b  # rows that decode
            lines.append(f"| {name} | {b} | " + " | ".join(str(m) for m in ms) + f" | {rows * 1000 / ms[0]:.0f} |")
    (out / "bench-decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
