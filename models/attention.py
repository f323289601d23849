"""Attention for the per-slot cache: transformers' SDPA path, with grouped-query heads packed for decode, and on
the CPU an attention op that reads only the cache positions the rows can see.

Under torch.compile transformers' SDPA path expands K/V to every query head (`repeat_kv`): for a decode step
that copies the whole static cache once per query head (3x for SmolLM2), which made the compiled decode
2.5x slower than eager here. For one query token we fold the query heads of each KV group into the query
axis instead (`[b, H, 1, D] -> [b, H_kv, H/H_kv, D]`): plain reshapes, no `enable_gqa` flag, so any backend
(inductor, neuron) compiles it.

On the CPU, decode and chunk steps call the op `bucketserve::attention` instead of SDPA in the graph. It is
opaque to the compiler (static shapes in and out) and looks at the mask at run time: rows are split into
runs of consecutive rows (`segments`), each attended in one SDPA call over the positions its longest row
sees; positions beyond are never read. So the KV bucket bounds the work instead of setting it: a batch-8 bf16
step at position 150 costs the same in the 256, 1024 and 2048 buckets (46 ms; 59 / 89 ms before in 256 /
1024). Exact: a cut position has softmax weight 0 in every row it is cut from. Devices that compile whole
graphs (neuron, cuda) keep SDPA in the graph over the bucket; the KV buckets are what bound their work.

Mixed steps (CPU) call `bucketserve::mixed_attention` (models/mixed_attention.py), whose "mask" is the step's
(slot, position) per token; prefills call `bucketserve::causal_attention`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from models import mixed_attention as _mixed  # noqa: F401  registers bucketserve::mixed_attention (packed_sdpa calls it)
from models import native_dispatch
from models.native import ATTENTION_DTYPES, decode_attention, decode_attention_masked, mask_extents, piece_attention
from models.row_segments import segments

ATTENTION = "bucketserve_sdpa"
_registered = False
_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
_LIB.define("attention_general(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
_LIB.define("causal_attention(Tensor query, Tensor key, Tensor value, float scale) -> Tensor")
_LIB.define("causal_attention_general(Tensor query, Tensor key, Tensor value, float scale) -> Tensor")


def _extents(mask: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """mask [b, 1, q, K] additive, 0 = attend -> (per row, 1 + the last position its last query attends; whether
    every row's last query attends exactly the positions before that, i.e. no sliding window cuts its start).
    Queries sit in position order (decode: one; chunks: causal, sliding windows move forward), so a row's last
    query reaches furthest. Read through numpy on the bit pattern (+0.0 is all zero bits): a quarter of the
    cost of the same four torch ops (15 vs 64 us for [16, 2048], in each of 30 layers), and the native kernels'
    C scan a tenth of that where they are on."""
    last = mask[:, 0, -1]
    scanned = mask_extents(last)
    if scanned is not None:
        return scanned
    bits = last.view(torch.int16 if last.element_size() == 2 else torch.int32).numpy()
    attended = bits == 0
    extents = last.shape[-1] - attended[:, ::-1].argmax(1)
    return tuple(extents.tolist()), bool((attended.sum(1) == extents).all())


def _attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """query [b, H, q, D], key/value [b, H_kv, K, D] (H a multiple of H_kv), mask [b, 1, q, K] additive float
    (0 = attend; q may be 1 and broadcast over packed query heads). Returns [b, H, q, D]. The op's Python kernel;
    its C++ one (models/csrc/dispatch.cpp) takes the same one-call decode path and calls `attention_general`
    where that declines."""
    if mask.shape[2] == 1 and query.shape[1] == key.shape[1]:  # decode (one query, heads packed [b, H_kv, G, D])
        out = decode_attention_masked(query, key, value, mask, scale)
        if out is not None:
            return out
    return _attention_general(query, key, value, mask, scale)


def _attention_general(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """_attention_cpu past its one-call decode path: the kernels' general decode entry (extents read from the
    mask), else SDPA over segments of rows of similar extents."""
    gqa = query.shape[1] != key.shape[1]
    extents, prefixes = _extents(mask)
    if mask.shape[2] == 1 and not gqa and prefixes:  # the kernels' general entry (the call above declined)
        out = decode_attention(query, key, value, np.arange(len(extents)), np.asarray(extents), scale)
        if out is not None:
            return out
    parts = [F.scaled_dot_product_attention(query[a:b], key[a:b, :, :w], value[a:b, :, :w],
                                            attn_mask=mask[a:b, ..., :w], scale=scale, enable_gqa=gqa)
             for a, b, w in segments(extents)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    return torch.empty_like(query)


def _causal_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill's attention: query [b, H, q, D], key/value [b, H_kv, q, D] (the rows' own positions 0..q-1);
    query i attends keys [0, i]. Returns [b, H, q, D]."""
    out = torch.empty_like(query)
    for row in range(query.shape[0]):
        if not piece_attention(query[row], key[row], value[row], out[row], 0, scale):
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                  enable_gqa=query.shape[1] != key.shape[1])
    return out


# the Python kernel, until native_dispatch.install() puts the C++ one (same choices) in its place
native_dispatch.PY_CPU.impl("attention", _attention_cpu)
_LIB.impl("attention_general", _attention_general, "CPU")  # what the C++ kernel calls where its path declines
native_dispatch.PY_CPU.impl("causal_attention", _causal_attention_cpu)  # until the C++ one replaces it
_LIB.impl("causal_attention_general", _causal_attention_cpu, "CPU")  # where the C++ kernel's path declines
torch.library.register_fake("bucketserve::attention", _attention_fake, lib=_LIB)
torch.library.register_fake("bucketserve::causal_attention", lambda q, k, v, scale: torch.empty_like(q), lib=_LIB)


def packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query: [b, H, q, D]; key/value: [b, H_kv, C, D]; mask: [b, 1, q, C] additive. Returns [b, q, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dtype == torch.long:  # a mixed step's (slot, position)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.ops.bucketserve.mixed_attention(query, key, value, attention_mask, scale)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and key.shape[-2] > attention_mask.shape[-1]:
        # A decode step of KV bucket K gets the slot buffers [b, H_kv, C, D]; it reads positions [0, K).
        kv_len = attention_mask.shape[-1]
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    groups = int(getattr(module, "num_key_value_groups", 1))
    b, heads, q_len, dim = query.shape
    mask_ok = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 \
        and attention_mask.is_floating_point()
    if (attention_mask is None and is_causal is not False and getattr(module, "is_causal", True) and 1 < q_len
            and key.shape[-2] == q_len and query.dtype in ATTENTION_DTYPES and _on_cpu(query) and not dropout
            and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
            and not q_len > (kwargs.get("sliding_window") or q_len)):
        # a prefill (transformers leaves the causal mask to is_causal): the prompt kernel where it takes the shapes
        scale = scaling if scaling is not None else dim ** -0.5
        out = torch.ops.bucketserve.causal_attention(query, key, value, scale)
        return out.transpose(1, 2).contiguous(), None
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
