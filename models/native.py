"""bucketserve's own CPU kernels (models/csrc/): attention and RMSNorm here, the matmuls of decode-sized steps in
models/native_matmul.py. Built once per machine with the C compiler the CPU path already needs (inductor compiles
its kernels with it), loaded through ctypes (models/native_library.py), and used by the attention ops (decoding
rows, prompt pieces), the RMSNorm op and the prepacked linear op.

Why kernels of our own (measured in docs/performance.md, one thread):
- Decode attention. A decode row has one query token, so per KV head a handful of queries (three for SmolLM2)
  against the row's positions. PyTorch's CPU SDPA is built for long query blocks and spends a decode step's
  attention in per-block overhead: 0.8 ms a layer for 16 rows at 250 positions (24 ms of a 77 ms bf16 step),
  ~2 GB/s of K/V. The kernel reads each row's K and V once, only the positions it sees, in one pass: ~2x.
- RMSNorm of prompt-sized steps (models/rms_norm.py): inductor's fused residual add and norm ~60-75 us a call at
  256 rows of 576 and ~380 at 1024, the kernel ~31 / ~130 (4-6% of a 128-1024-token prompt's step).
- Prompt attention (models/csrc/piece_attention.c): PyTorch's CPU flash SDPA spends most of a prompt's attention
  outside its two matmuls; the kernel computes each 16-token block's products from packed K and V (AMX tiles, or
  AVX512-BF16 dot products without AMX: 3-4x SDPA); without AMX a bf16 512-1024-token prompt's step -25 to -28%.
- A verify step's runs (a row's last token and its drafts; bf16: models/csrc/run_attention.c on AMX tiles, else
  run_vec.c on AVX512-BF16 dot products): the run's tokens read their slot's K/V once, together, where as decoding
  rows each token re-read it: 16 runs of 4 tokens at ~300 positions 585 us a layer against 1073 as 64 decoding rows
  (AMX); 8 such runs 4.4-4.9 against 6.7 ms over 30 layers without AMX (runs of 3+ tokens there).
float32 models take the attention kernels too (fp32 in and out: PyTorch's SDPA spent ~2.5x the decode kernel's time
on decode rows and 1.4-2.1x the prompt kernel's on prompts, docs/performance.md). Greedy tokens stay transformers'
eager float32 (`bucketserve verify`). Other dtypes, shapes the kernels do not take, and machines where the build
fails (logged once) use SDPA and inductor's kernels.
"""

from __future__ import annotations

import numpy as np
import torch

from models.native_library import available as available
from models.native_library import configure as configure
from models.native_library import enabled as enabled
from models.native_library import f32_mkl_rows as f32_mkl_rows
from models.native_library import has
from models.native_library import lib as _lib
from models.native_library import threads as _threads

MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # decode_attention.c's MAX_G and 16 * MAX_C


ATTENTION_DTYPES = (torch.bfloat16, torch.float32)  # decode_attention.c's and piece_attention.c's element types


def decode_kernel(dtype: torch.dtype) -> bool:
    """A decode attention kernel for `dtype` is built and faster than SDPA here: decode_attention.c's 16-lane one
    with AVX-512; on an AVX2-only CPU (where that one lowers to scalar code, 3-4x slower than SDPA) decode_avx2.c's
    8-lane one for fp32, and none for bf16 (`bucketserve_decode_fast`)."""
    if dtype not in ATTENTION_DTYPES or not available():
        return False
    return has("decode_f32" if dtype == torch.float32 else "decode_bf16")


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
    threads = _threads() if decode_kernel(query.dtype) else None
    if threads is None:
        return None  # unavailable or slower than SDPA here, or a serial kernel that would lose to SDPA's threads
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
            or key.shape[0] < rows or not _decode_takes(query, key, value) or not decode_kernel(query.dtype)):
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
    fp32: AVX-512 FMAs, or AVX2 ones (piece_avx2.c) without AVX-512, fp32 throughout. Returns False, leaving `out`
    alone, where the kernel does not take the inputs (the caller uses SDPA)."""
    heads, n, dim = query.shape
    kv_heads = key.shape[0]
    if (query.dtype not in ATTENTION_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype
            or out.dtype != query.dtype or out.shape != query.shape or key.dim() != 3 or value.shape != key.shape
            or key.shape[2] != dim or heads % kv_heads or dim % 32 or not 32 <= dim <= MAX_HEAD_DIM
            or query.stride(2) != 1 or out.stride(2) != 1 or key.stride(2) != 1 or key.stride(1) < dim or key.stride(1) % 2
            or value.stride() != key.stride() or not 0 <= start or start + n > key.shape[1] or n < 1
            or not available() or not has("piece_f32" if query.dtype == torch.float32 else "matmul")):
        # "matmul": the build has AVX512-BF16 (the bf16 kernel's guard); fp32 also runs on AVX2 (piece_avx2.c)
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


def argmax(logits: torch.Tensor) -> list[int] | None:
    """logits [rows, V] (bf16 or fp32, CPU, unit stride along V) -> each row's first maximum, as
    torch.max(dim=-1).indices (a row with a NaN: its first NaN), from models/csrc/argmax.c; None where the kernels
    are off or do not take the tensor (the caller uses torch.max)."""
    if (logits.dim() != 2 or logits.device.type != "cpu" or logits.dtype not in ATTENTION_DTYPES
            or logits.stride(1) != 1 or not logits.shape[1] or not available()):
        return None
    stride = logits.stride(0) if logits.shape[0] > 1 else logits.shape[1]
    out = np.empty(logits.shape[0], dtype=np.int64)
    status: int = _lib().bucketserve_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], stride,
                                            int(logits.dtype == torch.float32), out.ctypes.data, _threads() or 1)
    return out.tolist() if status == 0 else None
