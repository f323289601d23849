"""bucketserve's own CPU kernels (models/csrc/): attention, and matmuls for decode-sized steps. Built
once per machine with the C compiler the CPU path already needs (inductor compiles its kernels with it), loaded
through ctypes, and used by the attention ops (decoding rows, prompt pieces) and the prepacked linear op (bf16
steps of 1-128 rows, fp32 one-row steps).

Why kernels of our own (measured in docs/performance.md, one thread):
- Decode attention. A decode row has one query token, so per KV head a handful of queries (three for SmolLM2)
  against the row's positions. PyTorch's CPU SDPA is built for long query blocks and spends a decode step's
  attention in per-block overhead: 0.8 ms a layer for 16 rows at 250 positions (24 ms of a 77 ms bf16 step),
  ~2 GB/s of K/V. The kernel reads each row's K and V once, only the positions it sees, in one pass: ~2x.
- Small matmuls. A decode step's linears read every weight once for a few rows: memory-bound. oneDNN's bf16
  matmul reads ~8.5 GB/s here; the kernel streams each weight row once with AVX512-BF16 dot products at 10.5-11.4
  GB/s (1.4x at one row, 1.16x at four; oneDNN from eight rows on).
- AMX matmuls. Where the CPU has AMX, 2-128 rows run tile products over a third copy of each weight in the
  tiles' layout (`tile_pack`): the arithmetic of 1-16 rows is one tile product, so the loop streams the weight
  (1.3-1.4x oneDNN at 2-32 rows, 1.1-1.2x at 48-128; oneDNN from 256 rows on).
- Without AMX (AVX512-BF16), 1-128 rows run vector products over the same tile copy (tiled_matmul.c: each tile
  row is 16 columns' weight pairs, one dot product against a broadcast input pair; the stream prefetched into
  L2): on an AMD EPYC 1.3x the small matmul at one row and 1.4-2x oneDNN at 1-16 rows.
- RMSNorm of prompt-sized steps (models/rms_norm.py): inductor's fused residual add and norm ~60-75 us a call at
  256 rows of 576 and ~380 at 1024, the kernel ~31 / ~130 (4-6% of a 128-1024-token prompt's step).
- Prompt attention (models/csrc/piece_attention.c): PyTorch's CPU flash SDPA spends most of a prompt's attention
  outside its two matmuls; the kernel computes each 16-token block's products from packed K and V (AMX tiles, or
  AVX512-BF16 dot products without AMX: 3-4x SDPA); without AMX a bf16 512-1024-token prompt's step -25 to -28%.
float32 models take the attention kernels (fp32 in and out: PyTorch's SDPA spent ~2.5x the decode kernel's time on
decode rows and 1.4-2.1x the prompt kernel's on prompts, docs/performance.md) and, for steps of 1-32 rows, the fp32
vector matmul on a fp32 tile copy (tiled_matmul.c; AMD EPYC: one row 1.24x the plain-weight one-row matmul of
small_matmul.c, itself ~1.5x MKL's sgemv; 8 rows 1.8x oneDNN); oneDNN for linears of more rows. Greedy tokens
stay transformers' eager float32 (`bucketserve verify`). Other dtypes, shapes the kernels do not take, and
machines where the build fails (logged once) use SDPA, MKL and oneDNN.
The library's build and loading: models/native_library.py.
"""

from __future__ import annotations

import numpy as np
import torch

from models.native_library import available as available
from models.native_library import configure as configure
from models.native_library import enabled as enabled
from models.native_library import has
from models.native_library import lib as _lib
from models.native_library import threads as _threads

SMALL_MATMUL_MAX_ROWS = 4  # the kernel's MAX_ROWS (small_matmul.c): oneDNN is as fast from 8 rows on
# Rows a step's linears take the small matmul for where there is neither AMX nor a tile copy (a weight whose N is
# not a multiple of 32): one and two (16 / 8 weight rows in flight); three and four go to oneDNN (measured on an AMD
# EPYC, the 211 weights of a SmolLM2 step at 4 rows: 28.9 ms in the small matmul, 18.9 in oneDNN; 1 row 18.7 vs
# 21.8, 2 rows 21.4-21.9 vs 24.3).
SMALL_MATMUL_STEP_ROWS = 2
# Rows the AMX kernel takes (amx_matmul.c): 1.1x oneDNN at 128 rows, 0.96x at 256. One row stays with the small
# matmul (as fast there, 18.4-18.6 vs 18.4-18.9 ms for SmolLM2's 210 linears, and it needs no AMX).
AMX_MIN_ROWS, AMX_MAX_ROWS = 2, 128
# Rows the vector kernel on the tile copy takes where there is no AMX (tiled_matmul.c; AMD EPYC, the 211 weights of
# a SmolLM2 step: 64 rows 79 ms against oneDNN's 89, 272 rows 337 against 343: even from there on).
TILED_MAX_ROWS = 128
# Rows of float32 steps the fp32 vector kernel takes (tiled_matmul.c, the same CPU and weights in fp32: 1.2x oneDNN
# at 32 rows, even at 64, 0.97x at 128).
TILED_F32_MAX_ROWS = 32
MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # decode_attention.c's MAX_G and 16 * MAX_C


ATTENTION_DTYPES = (torch.bfloat16, torch.float32)  # decode_attention.c's and piece_attention.c's element types


def _decode_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """decode_attention.c takes these layouts: query [R, H_kv, G, D], key/value [S, H_kv, C, D] with the same
    strides, positions contiguous, all bf16 or all fp32, G <= MAX_GROUPS, D a multiple of 16 up to MAX_HEAD_DIM."""
    _, heads, groups, dim = query.shape
    return not (query.dtype not in ATTENTION_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
                or key.shape[1] != heads or key.shape[3] != dim or value.shape != key.shape
                or value.stride() != key.stride() or key.stride(3) != 1 or key.stride(2) != dim
                or not 1 <= groups <= MAX_GROUPS or dim % 16 or not 16 <= dim <= MAX_HEAD_DIM)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: np.ndarray,
                     extents: np.ndarray, scale: float) -> torch.Tensor | None:
    """query [R, H_kv, G, D] (the G query heads of each KV head packed); key/value: slot buffers [S, H_kv, C, D]
    (positions contiguous); row r attends positions [0, extents[r]) of slot slots[r] (int64 arrays [R]).
    Returns [R, H_kv, G, D], or None when the kernel does not take these inputs (the caller uses SDPA)."""
    rows, heads, groups, dim = query.shape
    if not _decode_takes(query, key, value):
        return None
    if (len(slots) != rows or len(extents) != rows or (rows and (slots.min() < 0 or slots.max() >= key.shape[0]
            or extents.min() < 1 or extents.max() > key.shape[2]))):
        raise ValueError("decode attention: a row's slot or extent is out of range")
    threads = _threads() if available() else None
    if threads is None:
        return None  # unavailable, or a serial kernel that would lose to SDPA's threads
    q = query.contiguous()
    out = torch.empty_like(q)
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    extents = np.ascontiguousarray(extents, dtype=np.int64)
    status = _lib().bucketserve_decode_attention(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), slots.ctypes.data, extents.ctypes.data,
        rows, heads, groups, dim, key.stride(0), key.stride(1), scale, threads, int(q.dtype == torch.float32))
    return out if status == 0 else None


def decode_attention_masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor | None:
    """decode_attention with row r on slot r and its extent read from mask row r by the kernel: mask [R, 1, 1, K]
    additive (0 bits = attend). One C call a layer: the per-layer numpy bookkeeping of the general path cost more
    than the kernel at one row. None where the kernel does not take the inputs, or a row does not attend exactly a
    non-empty prefix of its slot (the caller then takes the general path, which handles both)."""
    rows, heads, groups, dim = query.shape
    if (mask.dim() != 4 or mask.shape[0] != rows or mask.shape[2] != 1 or mask.stride(3) != 1
            or key.shape[0] < rows or not _decode_takes(query, key, value) or not available()):
        return None
    threads = _threads()
    if threads is None:
        return None
    q = query.contiguous()
    out = torch.empty_like(q)
    status: int = _lib().bucketserve_decode_attention_masked(
        q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), mask.data_ptr(), mask.stride(0),
        mask.shape[3], mask.element_size(), rows, heads, groups, dim, key.stride(0), key.stride(1), key.shape[2],
        scale, threads, int(q.dtype == torch.float32))
    return out if status == 0 else None


def piece_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, start: int,
                    scale: float) -> bool:
    """A prompt piece's causal attention over its slot, into `out`: query and out [H, n, D] (views, D contiguous),
    key/value [H_kv, C, D] (D contiguous: a slot's buffers, or a prefill's keys); token t (position start + t) attends
    positions [0, start + t]. bf16: AMX tiles where this process may use them, else AVX512-BF16 dot products;
    fp32: AVX-512 FMAs, fp32 throughout. Returns False, leaving `out` alone, where the kernel does not take the
    inputs (the caller uses SDPA)."""
    heads, n, dim = query.shape
    kv_heads = key.shape[0]
    if (query.dtype not in ATTENTION_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
            or out.dtype != query.dtype or out.shape != query.shape or key.dim() != 3 or value.shape != key.shape
            or key.shape[2] != dim or heads % kv_heads or dim % 32 or not 32 <= dim <= MAX_HEAD_DIM
            or query.stride(2) != 1 or out.stride(2) != 1 or key.stride(2) != 1 or key.stride(1) < dim or key.stride(1) % 2
            or value.stride() != key.stride() or not 0 <= start or start + n > key.shape[1] or n < 1
            or not available() or not has("matmul")):  # "matmul": the build has AVX512-BF16 (the kernel's guard)
        return False
    threads = _threads()
    if threads is None:
        return False
    f32 = query.dtype == torch.float32
    status: int = _lib().bucketserve_piece_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), n, start, heads, kv_heads, dim,
        query.stride(1), query.stride(0), out.stride(1), out.stride(0), key.stride(0), key.stride(1), scale, threads,
        int(has("amx") and not f32), int(f32))
    return status == 0


def small_matmul(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """rows [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] for bf16 with M <= SMALL_MATMUL_MAX_ROWS, or None when
    the kernel does not take these inputs (no AVX512-BF16, K not a multiple of 32, N of 16, ...): the caller
    uses oneDNN."""
    m, k = rows.shape
    if (not 0 < m <= SMALL_MATMUL_MAX_ROWS or rows.dtype != torch.bfloat16 or not small_matmul_takes(weight)
            or weight.shape[1] != k):
        return None
    return _checked(rows, (SMALL, weight.data_ptr(), 0), weight.shape[0], bias)


def mask_extents(rows: torch.Tensor) -> tuple[tuple[int, ...], bool] | None:
    """rows [R, K]: additive mask rows (0 bits = attend) -> (per row, 1 + its last attended position, or K when it
    attends none; whether every row attends exactly the positions before that). None when the kernels are off
    or the layout does not fit (the caller scans in numpy: same result)."""
    if rows.dim() != 2 or rows.stride(1) != 1 or rows.element_size() not in (2, 4) or not available():
        return None
    ext = np.empty(rows.shape[0], dtype=np.int64)
    prefix = _lib().bucketserve_mask_extents(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                                             rows.element_size(), ext.ctypes.data)
    return None if prefix < 0 else (tuple(ext.tolist()), prefix == 1)


def amx_available() -> bool:
    """The kernels are available and this CPU and process can run the AMX matmul."""
    return available() and has("amx")


def tiled_available() -> bool:
    """The vector matmul on the tile copy (tiled_matmul.c) runs here: the kernels' build has AVX512-BF16 and the
    CPU no AMX (where it has, the tiles' own products read the copy)."""
    return available() and has("matmul") and not has("amx")


def tile_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] bf16 -> its copy in the tiles' layout [N/32, K/32, 2, 16, 16, 2] (amx_matmul.c: tile j of
    column group g and k block b holds w[32g + 16j + n, 32b + 2r + i] at [g, b, j, r, n, i]), read by the AMX
    matmul or, without AMX, the vector one; None when neither runs here or N, K are not multiples of 32."""
    return _tiled(weight.detach()) if _tiles_take(weight, amx_available() or tiled_available()) else None


def f32_tile_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [N, K] fp32 -> its copy for the fp32 vector matmul, [N/32, K, 32] (tiled_matmul.c: the 32 weights of
    column group g at k are [g, k, :]), or None when the kernel does not run here or N is not a multiple of 32."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if weight.dtype != torch.float32 or not n or not k or n % 32 or not available() or not has("matmul"):
        return None
    return weight.detach().view(n // 32, 32, k).transpose(1, 2).contiguous()


def tiled_matmul_f32(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
    """rows [M, K] fp32 @ w.T -> [M, N] fp32 for 1 <= M <= TILED_F32_MAX_ROWS, from w's copy made by f32_tile_pack;
    None when the kernel does not take these inputs."""
    m, k = rows.shape
    if (not 1 <= m <= TILED_F32_MAX_ROWS or rows.dtype != torch.float32 or packed.dtype != torch.float32
            or packed.dim() != 3 or packed.shape[1] != k or packed.shape[2] != 32 or not packed.is_contiguous()
            or not available() or not has("matmul")):
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


# (kind, weight copy's address, scales' address or 0): what linear.c's entries read. kind 0: the small matmul on
# the plain weight; 1: the AMX matmul on the tile copy (tile_pack); 2: the int8 tile copy and its scales (int8_pack);
# 3: the float32 one-row matmul on the plain fp32 weight; 4: the vector matmul on the tile copy (no AMX); 5: the fp32
# vector matmul on the fp32 tile copy (f32_tile_pack)
Kernel = tuple[int, int, int]
SMALL, AMX, AMX_INT8, ONE_ROW_F32, TILED, TILED_F32 = 0, 1, 2, 3, 4, 5


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., D] bf16 contiguous, weight [D] bf16 -> RMSNorm(x) * weight [..., D] bf16, rounded as the eager bf16
    formula rounds (rms_norm.c); None when the kernels are off or do not take the inputs (the caller runs eager)."""
    d = x.shape[-1]
    if (not available() or x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16
            or weight.shape != (d,) or not x.is_contiguous() or not weight.is_contiguous()):
        return None
    threads = _threads()
    if threads is None:
        return None
    out = torch.empty_like(x)
    if _lib().bucketserve_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(d, 1), d,
                                        eps, threads):
        return None
    return out


def int8_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] bf16 -> (q, scale): its weight-only int8 quantization, per output column (symmetric:
    scale [N] fp32 = max |w[n]| / 127, q = round(w / scale) in [-127, 127]), q in tile_pack's layout (one byte an
    element); None where the AMX kernel cannot read it. w ~ q * scale to half a step (scale / 2) per element."""
    if not _tiles_take(weight, amx_available()):
        return None
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return _tiled(q), scale.contiguous()


def int8_matmul(rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """rows [M, K] bf16 @ (q * scale).T (+ bias [N]) -> [M, N] bf16 for 1 <= M <= AMX_MAX_ROWS, from int8_pack's
    pair (the AMX kernel converts the int8 tiles to bf16 as it reads them, and scales each column's fp32 sum
    before the one rounding); None when the kernel does not take these inputs."""
    m, k = rows.shape
    n = q.shape[0] * 32 if q.dim() == 6 else 0
    if (not 1 <= m <= AMX_MAX_ROWS or rows.dtype != torch.bfloat16 or q.dtype != torch.int8 or not n
            or q.shape[1] * 32 != k or not q.is_contiguous() or scale.dtype != torch.float32
            or scale.shape != (n,) or not scale.is_contiguous() or not amx_available()):
        return None
    return _checked(rows, (AMX_INT8, q.data_ptr(), scale.data_ptr()), n, bias)


def _checked(rows: torch.Tensor, kernel: Kernel, n: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The checked entries above (small_matmul, amx_matmul, int8_matmul: kernel tests and direct callers) after
    their checks: packed_linear (+ bias)."""
    out = packed_linear(rows.contiguous(), kernel, n)
    return out if out is None or bias is None else out.add_(bias)
