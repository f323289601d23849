"""float32 weights held exactly as 4-bit codes (models/csrc/exact4.c): where every block of 32 weights along k of an
output row takes only values fma(q, d, m), q in 0..15, the block's (d, m) and its codes rebuild the fp32 weight bit
for bit, in 0.75 bytes a weight instead of 4.

Why: a fp32 decode step of a few rows is bound by reading its weights from memory. A checkpoint that was quantized
before it was stored in fp32 has this form: the default model is SmolLM2-135M-Instruct's GGUF Q4_1 file dequantized
(models/loading.py), so each of its 210 layer weights is, block by block, an fp16 scale d times a code plus an fp16
minimum m. Nothing is approximated: pack() checks every weight against its codes and returns None for any weight
that does not rebuild exactly (a checkpoint trained or stored in fp32 or bf16), whose steps then read the fp32 tile
copy as before.
"""

from __future__ import annotations

import torch

from models import native_library

_PACK_ROWS = 1024  # output rows checked and packed at a time (a multiple of 32): bounds the temporaries


def available() -> bool:
    """This build has the kernel (AVX2 with FMA, or AVX-512)."""
    return native_library.available() and native_library.has("exact4") and native_library.has("f32")


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight [N, K] fp32 -> (codes [N/32, K, 16] uint8, pairs [N/32, K/32, 2, 32] fp32), exact4.c's copy, when every
    block of 32 weights along k is fma(q, d, m) with codes q in 0..15; None when one is not, when N or K is not a
    multiple of 32, or when the kernel does not run here.

    Each block's m is its minimum (a code of 0) and d is (max - min) / 15 rounded to fp16, as a Q4_1 quantizer
    stores it; the check then asks that q d + m equal the weight exactly (in float64, where q d is exact: the kernel's
    single-rounding FMA of that value gives the same fp32)."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % 32 or weight.shape[1] % 32
            or not available()):
        return None
    w = weight.detach()
    n, k = w.shape
    codes = torch.empty(n // 32, k, 16, dtype=torch.uint8)
    pairs = torch.empty(n // 32, k // 32, 2, 32, dtype=torch.float32)
    for start in range(0, n, _PACK_ROWS):
        block = w[start : start + _PACK_ROWS]
        rows = block.shape[0]
        blocks = block.reshape(rows, k // 32, 32)
        low = blocks.amin(dim=2)  # [rows, K/32]
        scale = ((blocks.amax(dim=2) - low) / 15).to(torch.float16).to(torch.float32)
        if not bool(torch.isfinite(scale).all()) or not bool(torch.isfinite(low).all()):
            return None
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((blocks - low[..., None]) / safe[..., None]).clamp_(0, 15)
        rebuilt = q.double() * scale.double()[..., None] + low.double()[..., None]
        if not bool((rebuilt == blocks.double()).all()):
            return None
        q8 = q.to(torch.uint8).reshape(rows // 32, 32, k)  # [groups, column, k]
        codes[start // 32 : (start + rows) // 32] = (q8[:, :16] | (q8[:, 16:] << 4)).transpose(1, 2)
        group_pairs = torch.stack((scale, low), dim=1).reshape(rows // 32, 32, 2, k // 32)
        pairs[start // 32 : (start + rows) // 32] = group_pairs.permute(0, 3, 2, 1)
    return codes, pairs
