"""Decode attention with the native kernel on and off, one compute thread: the op alone over 30 layers' caches
(rows at a position, KV bucket 2048, SmolLM2's 3 KV heads x 3 query heads x 64), and with `--steps` whole decode
steps of the default model, the kernel switched on and off between rounds in one process (the graphs are the same:
the attention op chooses at run time). Rounds alternate the order; medians per round.

Usage: python scripts/bench_decode_attention.py [--dtypes float32,bfloat16] [--steps] [--rounds 4]
Writes results/bench-decode-attention.json.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

from bench_prompt import median_ms  # scripts/ is on the path of a script run from it

CASES = ((1, 150), (8, 150), (16, 250))  # (rows, position)


def op_alone(dtype_name: str, rounds: int) -> dict[str, list[float]]:
    """ms for 30 layers of `bucketserve::attention` on decode rows, kernel on / off, per round."""
    import torch

    import models.attention  # noqa: F401  registers the op
    from models import native_library

    dtype = getattr(torch, dtype_name)
    slots, heads, context, dim, groups, layers = 17, 3, 2048, 64, 3, 30
    caches = [(torch.randn(slots, heads, context, dim).to(dtype), torch.randn(slots, heads, context, dim).to(dtype))
              for _ in range(layers)]
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            native_library.configure(on)
            for rows, position in CASES:
                q = torch.randn(rows, heads, groups, dim).to(dtype)
                mask = torch.full((rows, 1, 1, context), float("-inf"), dtype=dtype)
                mask[..., :position] = 0

                def layers_once(q: torch.Tensor = q, mask: torch.Tensor = mask) -> None:
                    for k, v in caches:
                        torch.ops.bucketserve.attention(q, k, v, mask, dim ** -0.5)
                out.setdefault(f"{rows}@{position} {'on' if on else 'off'}", []).append(median_ms(layers_once, 7))
    native_library.configure(True)
    return out


def steps(dtype_name: str, rounds: int) -> dict[str, Any]:
    """ms per decode step of the default model (KV bucket 2048), kernel on / off, per round."""
    import torch

    from buckets import BucketTable, GraphKey
    from models import native_library
    from models.compile import CompileSettings
    from models.loading import load_model, resolve_model_path
    from models.runner import ModelRunner

    model = load_model(resolve_model_path("default"), dtype_name, "cpu")
    batches = tuple(rows for rows, _ in CASES)
    table = BucketTable(lengths=(64,), batch_sizes=batches, prefill_batch_sizes=(1,), context_length=2048,
                        kv_lengths=(2048,))
    runner = ModelRunner(model, table, CompileSettings(backend="inductor"))
    runner.warmup([GraphKey("decode", b, 2048) for b in batches])
    out: dict[str, Any] = {}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            native_library.configure(on)
            for rows, position in CASES:
                tokens = 100 + 37 * torch.arange(rows)  # distinct: the linears run a repeat of the row before only once
                pos = torch.full((rows,), position, dtype=torch.long)
                ms = median_ms(functools.partial(runner.decode, rows, tokens, pos, 2048), 20)
                out.setdefault(f"{rows}@{position} {'on' if on else 'off'}", []).append(ms)
    native_library.configure(True)
    out["serving_compilations"] = runner.accountant.count("serving")
    return out


def main() -> int:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", action="store_true", help="also whole decode steps of the default model")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results"))  # the repo's, from any cwd
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        report[f"{dtype} op"] = op_alone(dtype, args.rounds)
        print(dtype, "op (30 layers, ms):", json.dumps(report[f"{dtype} op"]), flush=True)
        if args.steps:
            report[f"{dtype} steps"] = steps(dtype, args.rounds)
            print(dtype, "decode steps (ms):", json.dumps(report[f"{dtype} steps"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-decode-attention.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
