"""What a mixed step costs by token bucket: the default model's mixed graphs of each bucket (compiled once), each
run with `--rows` decoding rows (one token each, at position 150) and one prompt piece at offset 0 filling the
bucket; one compute thread, medians of `--reps`. The evidence for the scheduler's rule that cuts a mixed step at the
bucket below when its own would be mostly padding (buckets/scheduler.py, Scheduler._trimmed): a padding token costs
what a real one does.

Usage: python scripts/bench_mixed.py [--dtype bfloat16|float32] [--buckets 32,64,128,256,512,1024] [--rows 8]
Writes results/bench-mixed-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--buckets", default="32,64,128,256,512,1024")
    parser.add_argument("--rows", type=int, default=8, help="decoding rows in each step (< the smallest bucket)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    import torch

    from buckets import BucketTable, GraphKey
    from models.compile import CompileSettings
    from models.loading import load_model, resolve_model_path
    from models.runner import ModelRunner

    torch.set_num_threads(1)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    if args.rows >= buckets[0] or args.rows > 16:
        raise SystemExit("--rows must be below the smallest bucket and at most 16 (the table's batch)")
    model = load_model(resolve_model_path("default"), args.dtype, "cpu")
    table = BucketTable(lengths=(32, 256), batch_sizes=(16,), prefill_batch_sizes=(1,), context_length=2048,
                        kv_lengths=(2048,), chunked_prefill=True, mixed_tokens=buckets)
    runner = ModelRunner(model, table, CompileSettings(backend="inductor"))
    runner.warmup([GraphKey("mixed", 16, t) for t in buckets])
    rows = args.rows
    result: dict[str, float] = {}
    for tokens in buckets:
        piece = tokens - rows
        ids = [1000 + i for i in range(rows)] + [2000 + i for i in range(piece)]
        positions = [150 + i for i in range(rows)] + list(range(piece))
        slots = list(range(rows)) + [rows] * piece  # the piece in the slot after the decoding rows'
        keep = list(range(rows)) + [tokens - 1]
        runner.mixed(tokens, ids, positions, slots, keep)
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            runner.mixed(tokens, ids, positions, slots, keep)
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        result[str(tokens)] = round(ms, 2)
        print(f"bucket {tokens:5d}: {ms:7.1f} ms, {ms / tokens:.3f} ms a bucket token", flush=True)
    runner.stop_serving()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"bench-mixed-{args.dtype}.json"
    out.write_text(json.dumps({"dtype": args.dtype, "decoding_rows": rows, "ms": result}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
