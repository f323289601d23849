"""Attention for the per-slot cache: transformers' SDPA path, with grouped-query heads packed for decode, and on
the CPU an attention op that reads only the cache positions the rows can see.

Under torch.compile transformers' SDPA path expands K/V to every query head (`repeat_kv`): for a decode step
that copies the whole static cache once per query head (3x for SmolLM2), which made the compiled decode
2.5x slower than eager here. For one query token we fold the query heads of each KV group into the query
axis instead (`[b, H, 1, D] -> [b, H_kv, H/H_kv, D]`): plain reshapes, no `enable_gqa` flag, so any backend
(inductor, neuron) compiles it.

On the CPU, decode and chunk steps call the op `bucketserve::attention` instead of SDPA in the graph. It is
opaque to the compiler (static shapes in and out) and looks at the mask at run time: K/V positions that no
row attends (beyond the longest row) are cut off before SDPA, and when rows differ enough in length each row
attends over its own length alone. So the KV bucket bounds the work instead of setting it: a batch-8 bf16
step at position 150 costs the same in the 256, 1024 and 2048 buckets (46 ms; 59 / 89 ms before in 256 /
1024). Exact: a cut position has softmax weight 0 in every row it is cut from. Devices that compile whole
graphs (neuron, cuda) keep SDPA in the graph over the bucket; the KV buckets are what bound their work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "bucketserve_sdpa"
_registered = False
# When rows are attended one by one: measured with SmolLM2's bf16 layer shapes (one thread), a batch-8 SDPA
# costs ~0.085 us per row-position, one row alone ~0.06 us per position plus ~25 us per call inside this op
# (slicing, the call itself) = ~300 batched row-positions. Row by row wins when that sum is the smaller one:
# for rows far apart in length (7 rows at 150 + 1 at 1000), or all long (uniform rows above ~900).
ROW_CALL_POSITIONS = 300
ROW_POSITION_COST = 0.7

_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")


def _attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """query [b, H, q, D], key/value [b, H_kv, K, D] (H a multiple of H_kv), mask [b, 1, q, K] additive
    (0 = attend; q may be 1 and broadcast over packed query heads). Returns [b, H, q, D]."""
    # Queries sit in position order (decode: one; chunks: causal, sliding windows move forward), so a row's
    # last query reaches furthest: its mask row bounds the row. Reading one mask row rather than all q of
    # them matters for chunks: comparing [256, 2048] masks in 30 layers cost ~25 ms a chunk.
    seen = mask[:, 0, -1] == 0  # [b, K]: positions each row's last query attends
    width = seen.shape[-1]
    extents = (width - seen.flip(-1).to(torch.int32).argmax(-1)).tolist()  # 1 + each row's last position
    gqa = query.shape[1] != key.shape[1]
    longest, rows = max(extents), len(extents)
    if rows > 1 and sum(ROW_POSITION_COST * e + ROW_CALL_POSITIONS for e in extents) < rows * longest:
        parts = [F.scaled_dot_product_attention(query[i:i + 1], key[i:i + 1, :, :e], value[i:i + 1, :, :e],
                                                attn_mask=mask[i:i + 1, ..., :e], scale=scale, enable_gqa=gqa)
                 for i, e in enumerate(extents)]
        return torch.cat(parts)
    if longest < width:
        key, value, mask = key[:, :, :longest], value[:, :, :longest], mask[..., :longest]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    return torch.empty_like(query)


_LIB.impl("attention", _attention_cpu, "CPU")
torch.library.register_fake("bucketserve::attention", _attention_fake, lib=_LIB)


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
    mask_ok = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    if not mask_ok or kwargs.get("position_bias") is not None or dropout or (q_len != 1 and not _on_cpu(query)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    assert attention_mask is not None
    scale = scaling if scaling is not None else dim ** -0.5
    if q_len != 1:  # a chunk or a prefill, on the CPU
        out = torch.ops.bucketserve.attention(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    packed = query.reshape(b, heads // groups, groups, dim)  # head h = kv_head * groups + g, as repeat_kv
    if _on_cpu(query):
        out = torch.ops.bucketserve.attention(packed, key, value, attention_mask, scale)
    else:
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scale)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def _on_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


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
