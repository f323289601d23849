"""Weights in the form a GGUF Q4_1 checkpoint dequantized to float32 has (the default model's layers): each block of
32 weights along k is q d + m, q in 0..15, with d and m fp16 values (models/exact4.py packs such weights)."""

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
