"""Prompt processing on the default server table (one compute thread): lone 512- and 1024-token prompts as pieces
of 256 (a prefill, then mixed steps) and as one solo step (what the scheduler runs at an idle server), with prompt
attention in the kernel (models/csrc/piece_attention.c, the default: AMX tiles or AVX512-BF16 products for bf16,
AVX-512 FMAs for fp32) and in PyTorch's SDPA, alternated in one process (the graphs are the same: the attention
ops choose at run time), plus one layer's attention alone.

Usage: python scripts/bench_prompt.py [--dtype bfloat16|float32] [--rounds 3] [--repeats 5]. Writes
results/bench-prompt-<dtype>.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall ms of `repeats` calls of fn after one warm call (scripts/bench_decode_attention.py too)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 2)


def run(dtype_name: str, rounds: int, repeats: int, cache_dir: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import models.attention as attention
    import models.mixed_attention as mixed
    from models.native import piece_attention
    from models.runner import PrefillRow
    from server.compose import build_model
    from server.config import ServerSettings

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    settings = ServerSettings(model="default", dtype=dtype_name, num_threads=1, compile_cache_dir=cache_dir)
    model = build_model(settings)
    model.load_and_warm()
    runner = model.runner
    assert runner is not None
    ids = list(range(1000, 2024))

    def piece(offset: int) -> Callable[[], object]:
        return lambda: runner.mixed(256, ids[offset : offset + 256], list(range(offset, offset + 256)), [0] * 256,
                                    [255])

    def pieces(n: int) -> Callable[[], object]:
        def run() -> None:  # the first 256 by the prefill graph, the rest in mixed steps of 256
            runner.prefill([PrefillRow(0, ids[:256])], 256, 1)
            for offset in range(256, n, 256):
                piece(offset)()
        return run

    def solo(n: int) -> Callable[[], object]:  # one mixed step of n tokens, nothing decoding
        return lambda: runner.mixed(n, ids[:n], list(range(n)), [0] * n, [n - 1])

    cases: dict[str, Callable[[], object]] = {
        "prefill 256": lambda: runner.prefill([PrefillRow(0, ids[:256])], 256, 1),
        **{f"mixed 256 at {o}": piece(o) for o in (256, 512, 768)},
        "prompt 512 in pieces of 256": pieces(512),
        "prompt 1024 in pieces of 256": pieces(1024),
    }
    if runner.table.solo_budget >= 1024:  # the default table's solo steps (buckets/table.py)
        cases |= {"prompt 512, one solo step": solo(512), "prompt 1024, one solo step": solo(1024)}
    modes = {"kernel": piece_attention, "sdpa": lambda *args: False}
    steps: dict[str, dict[str, list[float]]] = {m: {c: [] for c in cases} for m in modes}
    for _ in range(rounds):
        for mode, fn in modes.items():
            attention.piece_attention = mixed.piece_attention = fn  # type: ignore[assignment]
            for case, call in cases.items():
                steps[mode][case].append(median_ms(call, repeats))
    attention.piece_attention = mixed.piece_attention = piece_attention

    # One layer's attention of a 256-token piece at position `start`, SmolLM2's heads (9 over 3 KV heads, D 64).
    torch.manual_seed(0)
    k, v = torch.randn(3, 2048, 64).to(dtype), torch.randn(3, 2048, 64).to(dtype)
    layer: dict[str, dict[str, float]] = {}
    for start in (0, 256, 512, 768):
        q = torch.randn(256, 9, 64).to(dtype).transpose(0, 1)
        out = torch.empty_like(q)
        end = start + 256
        seen = torch.arange(end)[None] <= torch.arange(start, end)[:, None]
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
        kernel = functools.partial(piece_attention, q, k, v, out, start, 0.125)
        sdpa = functools.partial(F.scaled_dot_product_attention, q[None], k[None, :, :end], v[None, :, :end],
                                 attn_mask=mask, scale=0.125, enable_gqa=True)
        layer[f"piece at {start}"] = {"kernel": median_ms(kernel, 30), "sdpa": median_ms(sdpa, 30)}
    summary = {m: {c: statistics.median(t) for c, t in per.items()} for m, per in steps.items()}
    return {"steps_ms": summary, "rounds_ms": steps, "layer_attention_ms": layer}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results"))  # the repo's, from any cwd
    parser.add_argument("--compile-cache-dir", default="auto")  # as serve: under ~/.cache/bucketserve
    args = parser.parse_args()
    result = run(args.dtype, args.rounds, args.repeats, args.compile_cache_dir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench-prompt-{args.dtype}.json").write_text(json.dumps(result, indent=2))
    lines = [f"| {args.dtype} step (ms, median of rounds) | kernel | SDPA |", "|---|---|---|"]
    for case, ms in result["steps_ms"]["kernel"].items():
        lines.append(f"| {case} | {ms:.1f} | {result['steps_ms']['sdpa'][case]:.1f} |")
    lines += ["", "| one layer's attention, 256 tokens (ms) | kernel | SDPA |", "|---|---|---|"]
    for case, ms in result["layer_attention_ms"].items():
        lines.append(f"| {case} | {ms['kernel']:.3f} | {ms['sdpa']:.3f} |")
    (out / f"bench-prompt-{args.dtype}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
