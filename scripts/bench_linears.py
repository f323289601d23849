"""The linears of one SmolLM2-135M step (211 weights: per layer q, k, v, o, gate, up, down, x 30, and the 49152 x 576
output head), random weights, through each kernel that can run them here, at a few row counts; one thread.

    python scripts/bench_linears.py [--dtype bfloat16|float32] [--rows 1,2,4,8,16,64] [--reps 7]

Prints, per row count, the median ms of the whole set for: oneDNN on its packed copy; PyTorch's matmul on the
plain weight (MKL, transformers' eager path); the vector matmul on the tile
copy (tiled_matmul.c); in bf16 where the CPU has AMX, the AMX matmul on the same copy (2-128 rows); the int8
kernel on the weights' int8 copy (`--quantize int8`: AMX's, or the vector one); and where they apply the small
matmul (bf16, 1-4 rows) and the one-row fp32 kernel (small_matmul.c) on the plain weight. Kernel calls go straight
to the C entry (models/native_matmul.packed_linear), as the linear op makes them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from models import native, native_matmul
from models.native_library import has

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]


def _median_ms(run: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _row_count(rows: int, dtype: torch.dtype, weights: list[torch.Tensor], onednn: list[torch.Tensor],
               tiles: list[torch.Tensor], int8: list[tuple[torch.Tensor, torch.Tensor]], reps: int
               ) -> dict[str, float]:
    """Median ms of the whole set at `rows` input rows, per kernel that takes them."""
    f32 = dtype == torch.float32
    inputs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}

    def dnn() -> None:
        for (_, k), w in zip(SHAPES, onednn):
            torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")

    def kernel(kind: int, copies: list[torch.Tensor], scales: list[torch.Tensor] | None = None) -> Callable[[], None]:
        calls = [(inputs[k], (kind, c.data_ptr(), scales[i].data_ptr() if scales else 0), n)
                 for i, ((n, k), c) in enumerate(zip(SHAPES, copies))]

        def run() -> None:
            for x, chosen, n in calls:
                if native_matmul.packed_linear(x, chosen, n) is None:
                    raise SystemExit(f"kernel {kind} declined {x.shape[0]} rows")

        return run

    def plain() -> None:  # MKL's matmul on the plain weight: what transformers' eager path runs
        for (_, k), w in zip(SHAPES, weights):
            torch.nn.functional.linear(inputs[k], w)

    result = {"oneDNN": _median_ms(dnn, reps), "plain": _median_ms(plain, reps)}
    if rows <= (native_matmul.tiled_f32_rows() if f32 else native_matmul.TILED_MAX_ROWS):
        result["tiled"] = _median_ms(kernel(native_matmul.TILED_F32 if f32 else native_matmul.TILED, tiles), reps)
    if not f32 and native_matmul.amx_available() and native_matmul.AMX_MIN_ROWS <= rows <= native_matmul.AMX_MAX_ROWS:
        result["amx"] = _median_ms(kernel(native_matmul.AMX, tiles), reps)
    if int8 and rows <= native_matmul.TILED_MAX_ROWS:
        result["int8"] = _median_ms(kernel(native_matmul.int8_kind(), [q for q, _ in int8], [s for _, s in int8]),
                                    reps)
    if f32 and rows == 1 and has("matmul"):
        result["one-row fp32"] = _median_ms(kernel(native_matmul.ONE_ROW_F32, weights), reps)
    if not f32 and rows <= native_matmul.SMALL_MATMUL_MAX_ROWS:
        result["small"] = _median_ms(kernel(native_matmul.SMALL, weights), reps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    if not (native.available() and has("f32" if dtype == torch.float32 else "matmul")):
        raise SystemExit("the native kernels need AVX512-BF16 on this CPU (float32: AVX-512 or AVX2 with FMA)")
    weights = [(torch.randn(n, k) * k ** -0.5).to(dtype) for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    packed = [native_matmul.f32_tile_pack(w) if dtype == torch.float32 else native_matmul._tiled(w) for w in weights]
    tiles = [t for t in packed if t is not None]
    quantized = [native_matmul.int8_pack(w) for w in weights] if dtype == torch.bfloat16 else []
    int8 = [q for q in quantized if q is not None] if all(q is not None for q in quantized) else []
    print(f"{args.dtype}, 211 weights ({sum(w.numel() * w.element_size() for w in weights) / 1e6:.0f} MB), "
          f"median ms of {args.reps}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        result = _row_count(rows, dtype, weights, onednn, tiles, int8, args.reps)
        print(f"rows {rows:4d}: " + ", ".join(f"{name} {ms:.1f}" for name, ms in result.items()), flush=True)


if __name__ == "__main__":
    main()
