"""float32 weights held exactly as small integer codes (models/csrc/exact_codes.c): where every block of 32 weights
along k of an output row takes only values fma(q, d, m) with q in 0..15 (4-bit), or q d with q in -128..127 (8-bit),
the block's scales and its codes rebuild the fp32 weight bit for bit, in 0.75 or 1.125 bytes a weight instead of 4.

Why: a fp32 decode step of a few rows is bound by reading its weights from memory. A checkpoint that was quantized
before it was stored in fp32 has this form: the default model is SmolLM2-135M-Instruct's GGUF file dequantized
(models/loading.py): its 210 layer weights are Q4_1 (block by block an fp16 scale d times a code plus an fp16
minimum m) and its embedding, which is also its lm_head, is Q8_0 (an fp16 scale times a signed byte). Nothing is
approximated: pack4() and pack8() check every weight against their codes and return None for any weight that does
not rebuild exactly (a checkpoint trained or stored in fp32 or bf16), whose steps then read the fp32 tile copy.
"""

from __future__ import annotations

import torch

from models import native_library

_PACK_ROWS = 1024  # output rows checked and packed at a time (a multiple of 32): bounds the temporaries


def available() -> bool:
    """This build has the kernels (AVX2 with FMA and no AVX-512: where they were measured)."""
    return native_library.available() and native_library.has("exact_codes") and native_library.has("f32")


def _takes(weight: torch.Tensor) -> bool:
    return (weight.dim() == 2 and weight.dtype == torch.float32 and not weight.shape[0] % 32
            and not weight.shape[1] % 32 and weight.numel() > 0 and available())


def _fp16(t: torch.Tensor) -> torch.Tensor | None:
    """t rounded to fp16 and back, or None where that is not finite (the scales of a Q4_1 or Q8_0 block are fp16)."""
    out = t.to(torch.float16).to(torch.float32)
    return out if bool(torch.isfinite(out).all()) else None


def pack4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] fp32 -> (codes [N/32, K, 16] uint8, pairs [N/32, K/32, 2, 32] fp32), exact_codes.c's 4-bit copy,
    when every block of 32 weights along k is fma(q, d, m) with codes q in 0..15; None when one is not, when N or K
    is not a multiple of 32, or when the kernel does not run here.

    Each block's m is its minimum (a code of 0) and d is (max - min) / 15 rounded to fp16, as a Q4_1 quantizer
    stores it; the check then asks that q d + m equal the weight exactly (in float64, where q d is exact: the kernel's
    single-rounding FMA of that value gives the same fp32)."""
    if not _takes(weight):
        return None
    w = weight.detach()
    n, k = w.shape
    codes = torch.empty(n // 32, k, 16, dtype=torch.uint8)
    pairs = torch.empty(n // 32, k // 32, 2, 32, dtype=torch.float32)
    for start in range(0, n, _PACK_ROWS):
        rows = min(_PACK_ROWS, n - start)
        blocks = w[start : start + rows].reshape(rows, k // 32, 32)
        low = blocks.amin(dim=2)  # [rows, K/32]
        scale = _fp16((blocks.amax(dim=2) - low) / 15)
        if scale is None or not bool(torch.isfinite(low).all()):
            return None
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((blocks - low[..., None]) / safe[..., None]).clamp_(0, 15)
        if not bool((q.double() * scale.double()[..., None] + low.double()[..., None] == blocks.double()).all()):
            return None
        q8 = q.to(torch.uint8).reshape(rows // 32, 32, k)  # [groups, column, k]
        codes[start // 32 : (start + rows) // 32] = (q8[:, :16] | (q8[:, 16:] << 4)).transpose(1, 2)
        group_pairs = torch.stack((scale, low), dim=1).reshape(rows // 32, 32, 2, k // 32)
        pairs[start // 32 : (start + rows) // 32] = group_pairs.permute(0, 3, 2, 1)
    return codes, pairs


def pack8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] fp32 -> (codes [N/32, K, 32] int8, scales [N/32, K/32, 32] fp32), exact_codes.c's 8-bit copy,
    when every block of 32 weights along k is q d with codes q in -128..127; None otherwise (as pack4).

    Each block's d is max |w| / 127 rounded to fp16, as a Q8_0 quantizer stores it; the check asks that q d equal
    the weight exactly (a product of 8 and 11 significant bits: exact in fp32, as the kernel computes it)."""
    if not _takes(weight):
        return None
    w = weight.detach()
    n, k = w.shape
    codes = torch.empty(n // 32, k, 32, dtype=torch.int8)
    scales = torch.empty(n // 32, k // 32, 32, dtype=torch.float32)
    for start in range(0, n, _PACK_ROWS):
        rows = min(_PACK_ROWS, n - start)
        blocks = w[start : start + rows].reshape(rows, k // 32, 32)
        scale = _fp16(blocks.abs().amax(dim=2) / 127)  # [rows, K/32]
        if scale is None:
            return None
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[..., None]).clamp_(-128, 127)
        if not bool((q.double() * scale.double()[..., None] == blocks.double()).all()):
            return None
        codes[start // 32 : (start + rows) // 32] = q.to(torch.int8).reshape(rows // 32, 32, k).transpose(1, 2)
        scales[start // 32 : (start + rows) // 32] = scale.reshape(rows // 32, 32, k // 32).transpose(1, 2)
    return codes, scales
