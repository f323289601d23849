"""Host-side cost of choosing tokens from a step's logits, one compute thread, the default model's vocabulary:
- the all-greedy path (server/engine/step_sampling.py): each row's maximum, by `argmax` and by `max(...).indices`
  (the same ids: both return the first maximum), on bfloat16 and float32 logits [rows, vocab];
- the host path (models/sampling.py `Sampler.sample`, penalties or flagged rows), per row.
Median of --repeats timings of --calls calls each.

Usage: python scripts/bench_sampling.py [--rows 1,8,16] [--vocab 49152]. Writes results/bench-sampling.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


def _median_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(times), 1)


def _argmax(x: torch.Tensor) -> list[int]:
    ids: list[int] = x.argmax(dim=-1).tolist()
    return ids


def _max_indices(x: torch.Tensor) -> list[int]:  # what step_sampling.py's greedy path runs
    ids: list[int] = x.max(dim=-1).indices.tolist()
    return ids


def run(rows: tuple[int, ...], vocab: int, calls: int, repeats: int) -> list[dict[str, object]]:
    import torch

    from models.params import SamplingParams
    from models.sampling import Sampler

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    out: list[dict[str, object]] = []
    for n in rows:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(n, vocab, generator=gen).to(dtype)
            if not torch.equal(x.argmax(dim=-1), x.max(dim=-1).indices):
                raise AssertionError("argmax and max().indices disagree")
            out.append({"rows": n, "dtype": str(dtype).removeprefix("torch."),
                        "argmax_us": _median_us(functools.partial(_argmax, x), calls, repeats),
                        "max_indices_us": _median_us(functools.partial(_max_indices, x), calls, repeats)})
    row = torch.randn(vocab, generator=gen).to(torch.bfloat16)
    for name, params in (("greedy + repetition penalty", SamplingParams(temperature=0.0, repetition_penalty=1.1)),
                         ("temperature 0.8, top-p 0.9", SamplingParams(temperature=0.8, top_p=0.9, seed=1))):
        sampler = Sampler(params, list(range(100)))
        out.append({"host_row": name, "us": _median_us(functools.partial(sampler.sample, row), max(1, calls // 10),
                                                       repeats)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    result = run(tuple(int(r) for r in args.rows.split(",")), args.vocab, args.calls, args.repeats)
    lines = ["| rows | dtype | argmax (us) | max().indices (us) |", "|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['dtype']} | {r['argmax_us']} | {r['max_indices_us']} |"
              for r in result if "rows" in r]
    lines += ["", "| host path, one row | us |", "|---|---|"]
    lines += [f"| {r['host_row']} | {r['us']} |" for r in result if "host_row" in r]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-sampling.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "bench-sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
