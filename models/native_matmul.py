"""bucketserve's matmuls for decode-sized steps (models/csrc/: small_matmul.c, amx_matmul.c, tiled_matmul.c,
linear.c), called by the prepacked linear op (models/prepack.py) and the gated MLP op (models/gated_mlp.py) on the
weight copies prepack makes once.

Why (measured in docs/performance.md, one thread):
- Small matmuls. A decode step's linears read every weight once for a few rows: memory-bound. oneDNN's bf16
  matmul reads ~8.5 GB/s here; the kernel streams each weight row once with AVX512-BF16 dot products at 10.5-11.4
  GB/s (1.4x at one row, 1.16x at four; oneDNN from eight rows on).
- AMX matmuls. Where the CPU has AMX, 2-128 rows run tile products over a third copy of each weight in the
  tiles' layout (`tile_pack`): the arithmetic of 1-16 rows is one tile product, so the loop streams the weight
  (1.3-1.4x oneDNN at 2-32 rows, 1.1-1.2x at 48-128; oneDNN from 256 rows on).
- Without AMX (AVX512-BF16), steps of every size run vector products over the same tile copy (tiled_matmul.c: each
  tile row is 16 columns' weight pairs, one dot product against a broadcast input pair; the stream prefetched into
  L2): on a Zen 4 EPYC 1.3x the small matmul at one row and 1.4-2x oneDNN at 1-16 rows; on a Zen 5 EPYC 1.1-1.2x
  oneDNN at 128-1024 rows (~500 GFLOP/s, the core's bf16 dot-product peak).
- Weight-only int8 (`--quantize int8`), 1-128 rows: AMX or the vector products read an int8 tile copy, converting
  it to bf16 as they go (half the bytes).
- float32: the same scheme with FMAs on a fp32 tile copy, for 1-32 rows with AVX-512 and 1-128 with AVX2 only
  (`tiled_f32_rows`; AMD EPYC: one row 1.24x the plain-weight one-row matmul of small_matmul.c, itself ~1.5x MKL's
  sgemv; 8 rows 1.8x oneDNN; Zen 3, AVX2: 1.3x oneDNN at 64 rows, 1.15-1.2x at 128); oneDNN for more rows, or
  MKL's matmul on AVX2 builds (`native_library.f32_mkl_rows`: 5-12% ahead of oneDNN at 256-1024 rows there).
- float32 weights that are exactly small integer codes times a scale per block of 32 (a Q4_1 or Q8_0 checkpoint
  stored in fp32, as the default model is): the same fp32 kernel's passes over weights rebuilt from those codes, 0.75
  or 1.125 bytes a weight, the same bits (models/exact_codes.py; Zen 3, 210 layer weights: 1 row 2.3x the fp32 tile
  copy, 8 rows 1.3x, level or ahead up to 128).
Shapes a kernel does not take, and machines without the kernels, use oneDNN (and MKL for one fp32 row).
"""

from __future__ import annotations

import torch

from models.native_library import available, has
from models.native_library import lib as _lib
from models.native_library import threads as _threads
from models.native_library import tiled_f32_rows as tiled_f32_rows

SMALL_MATMUL_MAX_ROWS = 4  # the kernel's MAX_ROWS (small_matmul.c): oneDNN is as fast from 8 rows on
# Rows a step's linears take the small matmul for where there is neither AMX nor a tile copy (a weight whose N is
# not a multiple of 32): one and two (16 / 8 weight rows in flight); three and four go to oneDNN (measured on an AMD
# EPYC, the 211 weights of a SmolLM2 step at 4 rows: 28.9 ms in the small matmul, 18.9 in oneDNN; 1 row 18.7 vs
# 21.8, 2 rows 21.4-21.9 vs 24.3).
SMALL_MATMUL_STEP_ROWS = 2
# Rows the AMX kernel takes (amx_matmul.c): 1.1x oneDNN at 128 rows, 0.96x at 256. One row stays with the small
# matmul (as fast there, 18.4-18.6 vs 18.4-18.9 ms for SmolLM2's 210 linears, and it needs no AMX).
AMX_MIN_ROWS, AMX_MAX_ROWS = 2, 128
# Rows the vector kernel on the tile copy takes where there is no AMX (tiled_matmul.c): every step size. SmolLM2's
# 210 layer weights, one thread: on a Zen 4 EPYC 64 rows 79 ms against oneDNN's 89, 272 rows 337 against 343; on a
# Zen 5 EPYC (docs/performance.md, session 48) 128 / 256 / 512 / 1024 rows 56 / 108 / 218 / 431 ms against 62 / 116 /
# 223 / 512: the kernel runs at the core's bf16 dot-product peak (~500 of ~520 GFLOP/s) at any size, and cutting a
# large step into row blocks of 64-512 measured the same.
TILED_MAX_ROWS = 1 << 16

# (kind, weight copy's address, scales' address or 0): what linear.c's entries read. kind 0: the small matmul on
# the plain weight; 1: the AMX matmul on the tile copy (tile_pack); 2: the int8 tile copy and its scales (int8_pack);
# 3: the float32 one-row matmul on the plain fp32 weight; 4: the vector matmul on the tile copy (no AMX); 5: the fp32
# vector matmul on the fp32 tile copy (f32_tile_pack); 6: the vector matmul on the int8 tile copy and its scales (no AMX);
# 7: the fp32 lm_head of greedy steps on the fp32 tile copy and its screen copy (models/greedy_head.py); 8 and 9: the
# fp32 vector matmul on the exact 4-bit or 8-bit copy of a weight that has one, its codes and their scales
# (models/exact_codes.py)
Kernel = tuple[int, int, int]
SMALL, AMX, AMX_INT8, ONE_ROW_F32, TILED, TILED_F32, TILED_INT8, GREEDY_HEAD_F32 = 0, 1, 2, 3, 4, 5, 6, 7
EXACT4_F32, EXACT8_F32 = 8, 9


def small_matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """rows [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] for bf16 with M <= SMALL_MATMUL_MAX_ROWS, or None when
    the kernel does not take these inputs (no AVX512-BF16, K not a multiple of 32, N of 16, ...): the caller
    uses oneDNN."""
    m, k = rows.shape
    if (not 0 < m <= SMALL_MATMUL_MAX_ROWS or rows.dtype != torch.bfloat16 or not small_matmul_takes(weight)
            or weight.shape[1] != k):
        return None
    return _checked(rows, (SMALL, weight.data_ptr(), 0), weight.shape[0], bias)


def amx_available() -> bool:
    """The kernels are available and this CPU and process can run the AMX matmul."""
    return available() and has("amx")


def tiled_available() -> bool:
    """The vector matmul on the tile copy (tiled_matmul.c) serves every step size here: the kernels' build has
    AVX512-BF16 and the CPU no AMX (where it has, the AMX matmul serves 2-128 rows, and this one rows of one)."""
    return available() and has("matmul") and not has("amx")


def tile_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 -> its copy in the tiles' layout [N/32, K/32, 2, 16, 16, 2] (amx_matmul.c: tile j of
    column group g and k block b holds w[32g + 16j + n, 32b + 2r + i] at [g, b, j, r, n, i]), read by the AMX
    matmul or, without AMX, the vector one; None when neither runs here or N, K are not multiples of 32."""
    return _tiled(weight.detach()) if _tiles_take(weight, amx_available() or tiled_available()) else None


def f32_tiles_take(weight: torch.Tensor) -> bool:
    """Whether f32_tile_pack copies `weight`: [N, K] fp32, N a multiple of 32, the kernel runs here."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return weight.dtype == torch.float32 and bool(n) and bool(k) and not n % 32 and available() and has("f32")


def f32_tile_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] fp32 -> its copy for the fp32 vector matmul, [N/32, K, 32] (tiled_matmul.c: the 32 weights of
    column group g at k are [g, k, :]), or None when the kernel does not run here or N is not a multiple of 32."""
    if not f32_tiles_take(weight):
        return None
    n, k = weight.shape
    return weight.detach().view(n // 32, 32, k).transpose(1, 2).contiguous()


def tiled_matmul_f32(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """rows [M, K] fp32 @ w.T -> [M, N] fp32 for 1 <= M <= tiled_f32_rows(), from w's copy made by f32_tile_pack;
    None when the kernel does not take these inputs."""
    m, k = rows.shape
    if (not available() or not 1 <= m <= tiled_f32_rows() or rows.dtype != torch.float32
            or packed.dtype != torch.float32 or packed.dim() != 3 or packed.shape[1] != k or packed.shape[2] != 32
            or not packed.is_contiguous()):
        return None
    return _checked(rows, (TILED_F32, packed.data_ptr(), 0), packed.shape[0] * 32, None)


def _tiles_take(weight: torch.Tensor, kernel: bool) -> bool:
    """A tile kernel (`kernel`: it runs here) can read a copy of this weight: [N, K] bf16, N and K multiples of
    32."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    return weight.dtype == torch.bfloat16 and n > 0 and k > 0 and not n % 32 and not k % 32 and kernel


def _tiled(w: torch.Tensor) -> torch.Tensor:
    """[N, K] (any element type) -> the tiles' layout [N/32, K/32, 2, 16, 16, 2] (see tile_pack)."""
    n, k = w.shape
    return w.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def amx_matmul(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """rows [M, K] @ w.T (+ bias [N]) -> [M, N] in bf16 for AMX_MIN_ROWS <= M <= AMX_MAX_ROWS, from w's copy made
    by tile_pack; None when the kernel does not take these inputs (the caller uses oneDNN)."""
    m, k = rows.shape
    if (not AMX_MIN_ROWS <= m <= AMX_MAX_ROWS or rows.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16
            or packed.dim() != 6 or packed.shape[1] * 32 != k or not packed.is_contiguous() or not amx_available()):
        return None
    return _checked(rows, (AMX, packed.data_ptr(), 0), packed.shape[0] * 32, bias)


def tiled_matmul(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """rows [M, K] @ w.T (+ bias [N]) -> [M, N] in bf16 for 1 <= M <= TILED_MAX_ROWS with the vector kernel, from
    w's copy made by tile_pack; None when it does not take these inputs (the caller uses oneDNN)."""
    m, k = rows.shape
    if (not 1 <= m <= TILED_MAX_ROWS or rows.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16
            or packed.dim() != 6 or packed.shape[1] * 32 != k or not packed.is_contiguous() or not available()
            or not has("matmul")):
        return None
    return _checked(rows, (TILED, packed.data_ptr(), 0), packed.shape[0] * 32, bias)


def small_matmul_takes(weight: torch.Tensor) -> bool:
    """small_matmul can read this weight as it is: [N, K] bf16, contiguous, K a multiple of 32, N of 16."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_contiguous()
            and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0 and available() and has("matmul"))


def one_row_f32_takes(weight: torch.Tensor) -> bool:
    """The float32 one-row matmul (small_matmul.c) can read this weight as it is: [N, K] fp32, contiguous, K and N
    multiples of 16 (built with the other AVX-512 kernels)."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.is_contiguous()
            and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0 and available() and has("matmul"))


def packed_linear(x: torch.Tensor, kernel: Kernel, n: int) -> torch.Tensor | None:
    """x [..., K] bf16 (fp32 for ONE_ROW_F32 and TILED_F32) contiguous @ the weight `kernel` reads (chosen once per weight by
    models/prepack.py) -> [..., N] in x's dtype; None when the kernel declines (the caller uses oneDNN). The lean
    path: the C side checks the shapes; the output is made in its final shape (a reshape and a view cost ~2 us of a
    ~10 us one-row call)."""
    threads = _threads()
    if threads is None:
        return None
    k = x.shape[-1]
    out = x.new_empty((*x.shape[:-1], n))
    kind, w, s = kernel
    if _lib().bucketserve_linear(x.data_ptr(), w, s, out.data_ptr(), x.numel() // k, n, k, kind, threads):
        return None
    return out


def packed_gated(x: torch.Tensor, gate: Kernel, up: Kernel, n: int) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) -> [..., N] bf16 in one call, x [..., K] bf16 contiguous, both weights read by
    the same kind of kernel; each matmul, silu and the product rounded to bf16 as eager does. None when the kernel
    declines."""
    threads = _threads()
    if threads is None or gate[0] != up[0]:
        return None
    k = x.shape[-1]
    out = x.new_empty((*x.shape[:-1], n))
    scratch = x.new_empty((*x.shape[:-1], n))
    if _lib().bucketserve_gated_bf16(x.data_ptr(), gate[1], gate[2], up[1], up[2], out.data_ptr(),
                                     scratch.data_ptr(), x.numel() // k, n, k, gate[0], threads):
        return None
    return out


def int8_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] bf16 -> (q, scale): its weight-only int8 quantization, per output column (symmetric:
    scale [N] fp32 = max |w[n]| / 127, q = round(w / scale) in [-127, 127]), q in tile_pack's layout (one byte an
    element); None where neither int8 kernel (AMX's, or the vector one without AMX) can read it. w ~ q * scale to
    half a step (scale / 2) per element."""
    if not _tiles_take(weight, amx_available() or tiled_available()):
        return None
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return _tiled(q), scale.contiguous()


def int8_matmul(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """rows [M, K] bf16 @ (q * scale).T (+ bias [N]) -> [M, N] bf16 for 1 <= M <= AMX_MAX_ROWS, from int8_pack's
    pair (the AMX kernel, or without AMX the vector one, converts the int8 weights to bf16 as it reads them, and
    scales each column's fp32 sum before the one rounding); None when no kernel takes these inputs."""
    m, k = rows.shape
    n = q.shape[0] * 32 if q.dim() == 6 else 0
    if (not 1 <= m <= AMX_MAX_ROWS or rows.dtype != torch.bfloat16 or q.dtype != torch.int8 or not n
            or q.shape[1] * 32 != k or not q.is_contiguous() or scale.dtype != torch.float32
            or scale.shape != (n,) or not scale.is_contiguous() or not int8_kind()):
        return None
    return _checked(rows, (int8_kind(), q.data_ptr(), scale.data_ptr()), n, bias)


def int8_kind() -> int:
    """The kernel that reads int8 copies here: AMX_INT8, TILED_INT8 without AMX, or 0 where neither runs."""
    return AMX_INT8 if amx_available() else TILED_INT8 if tiled_available() else 0


def _checked(rows: torch.Tensor, kernel: Kernel, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The checked entries above (small_matmul, amx_matmul, int8_matmul: kernel tests and direct callers) after
    their checks: packed_linear (+ bias)."""
    out = packed_linear(rows.contiguous(), kernel, n)
    return out if out is None or bias is None else out.add_(bias)
