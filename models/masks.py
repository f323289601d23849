"""Per-slot decode attention masks.

transformers expands a 2-D mask with one batch-wide query offset, which is wrong when every slot sits at its
own position (and wrong for sliding windows). A 4-D mask is passed through untouched, and models with mixed
layer types accept a dict keyed by layer type, so we build those ourselves, inside the compiled graph,
from the per-slot positions tensor.
"""

from __future__ import annotations

from typing import Any

import torch


def sliding_window(config: Any) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    return int(window) if window else None


def decode_mask(
    pos: torch.Tensor, kv_length: int, dtype: torch.dtype, layer_types: list[str], window: int | None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """pos: [b] long, the position each slot's new token is written to (< kv_length).
    Returns an additive float mask [b, 1, 1, K] (0 = attend, finfo.min = masked); finfo.min rather than
    -inf so that no row can turn into NaN. For mixed full/sliding models: a dict by layer type."""
    return _additive(pos.view(-1, 1), kv_length, dtype, layer_types, window, (-1, 1, 1, kv_length))


def chunk_mask(
    offset: torch.Tensor, chunk: int, kv_length: int, dtype: torch.dtype, layer_types: list[str], window: int | None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """offset: [1] long, the position of the chunk's first token. Query i sits at offset + i and sees
    positions <= offset + i (within the window for sliding layers). Returns [1, 1, chunk, K] additive."""
    q = offset.view(1, 1) + torch.arange(chunk, device=offset.device).view(chunk, 1)
    return _additive(q, kv_length, dtype, layer_types, window, (1, 1, chunk, kv_length))


def _additive(
    q: torch.Tensor, kv_length: int, dtype: torch.dtype, layer_types: list[str], window: int | None,
    shape: tuple[int, ...],
) -> torch.Tensor | dict[str, torch.Tensor]:
    """q: [rows, 1] query positions. The mask `kv <= q` (and `kv > q - window` for sliding layers) in
    additive form, viewed as `shape`; one mask, or a dict by layer type for mixed models."""
    kv = torch.arange(kv_length, device=q.device).view(1, kv_length)
    masked_value = torch.finfo(dtype).min
    zero = torch.zeros((), dtype=dtype, device=q.device)
    low = torch.full((), masked_value, dtype=dtype, device=q.device)
    masks: dict[str, torch.Tensor] = {}
    for kind in sorted(set(layer_types)):
        allowed = kv <= q
        if kind == "sliding_attention" and window is not None:
            allowed = allowed & (kv > q - window)
        masks[kind] = torch.where(allowed, zero, low).view(shape)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks
