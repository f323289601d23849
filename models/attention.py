"""Attention for the per-slot cache: transformers' SDPA path, with grouped-query heads packed for decode.

Under torch.compile transformers' SDPA path expands K/V to every query head (`repeat_kv`): for a decode step
that copies the whole static cache once per query head (3x for SmolLM2), which made the compiled decode
2.5x slower than eager here. For one query token we fold the query heads of each KV group into the query
axis instead (`[b, H, 1, D] -> [b, H_kv, H/H_kv, D]`): plain reshapes, no `enable_gqa` flag, so any backend
(inductor, neuron) compiles it. Prefill and everything else go to the stock SDPA function unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "bucketserve_sdpa"
_registered = False


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query: [b, H, q, D]; key/value: [b, H_kv, C, D]; mask: [b, 1, q, C] additive. Returns [b, q, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and key.shape[-2] > attention_mask.shape[-1]:
        # A decode step of KV bucket K gets the slot buffers [b, H_kv, C, D]; it reads positions [0, K).
        kv_len = attention_mask.shape[-1]
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    groups = int(getattr(module, "num_key_value_groups", 1))
    b, heads, q_len, dim = query.shape
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if q_len != 1 or groups == 1 or not mask_ok or kwargs.get("position_bias") is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    packed = query.reshape(b, heads // groups, groups, dim)  # head h = kv_head * groups + g, as repeat_kv
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function (and the SDPA mask builder under its name) with transformers."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(ATTENTION, packed_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
        _registered = True
    return ATTENTION
