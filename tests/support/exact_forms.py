"""Weights in the forms a GGUF checkpoint dequantized to float32 has (models/exact_codes.py packs them): Q4_1 (the
default model's layers: each block of 32 weights along k is q d + m, q in 0..15, d and m fp16 values) and Q8_0 (its
embedding and head: q d, q in -127..127, d an fp16 value)."""

from __future__ import annotations

import torch


def q4_form(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K a multiple of 32) -> the nearest weight of Q4_1 form, fp32: per block m = min and d =
    (max - min) / 15, both rounded to fp16, and every block holding codes 0 and 15 (as a Q4_1 quantizer's does, so
    the block's minimum is m and its maximum 15 d + m)."""
    n, k = weight.shape
    blocks = weight.detach().double().reshape(n, k // 32, 32)
    low = blocks.amin(dim=2, keepdim=True).to(torch.float16).double()
    scale = ((blocks.amax(dim=2, keepdim=True) - low) / 15).to(torch.float16).double().clamp_min(2.0 ** -14)
    q = torch.round((blocks - low) / scale).clamp_(0, 15)
    q.scatter_(2, blocks.argmin(dim=2, keepdim=True), 0.0)
    q.scatter_(2, blocks.argmax(dim=2, keepdim=True), 15.0)
    out = (q * scale + low).float()
    assert torch.equal(out.double(), q * scale + low), "a block's values are not exact in fp32"
    return out.reshape(n, k)


def q8_form(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K a multiple of 32) -> the nearest weight of Q8_0 form, fp32: per block d = max |w| / 127
    rounded to fp16, codes round(w / d)."""
    n, k = weight.shape
    blocks = weight.detach().double().reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).double().clamp_min(2.0 ** -14)
    q = torch.round(blocks / scale).clamp_(-127, 127)
    out = (q * scale).float()
    assert torch.equal(out.double(), q * scale)
    return out.reshape(n, k)
