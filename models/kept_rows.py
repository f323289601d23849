"""The last decoder layer's MLP on the rows whose logits a step keeps (a CPU module swap, models/module_swaps.py).

Why: a step's logits come from a few of its rows (a prompt piece's last token, the decoding rows and their drafts),
yet every row ran the whole last layer. Past that layer's attention, a row feeds nothing but its own logits: its
K/V for later tokens were written by the attention already. So the swapped layer zeroes the MLP's input on the
other rows, and the CPU kernels skip zero rows (models/csrc/dispatch.cpp, where a row's output is the same bits
whatever rows lie beside it): a 128-token step of one prompt piece and 12 decoding rows runs the last MLP on 13
rows, not 128 (its gated MLP and down projection are ~75% of a layer's weights). The kept rows are computed as
before, bit for bit; the others leave the layer with only its attention added, and nothing reads them.

Only decoder layers whose forward is Llama's (input norm, attention, residual, post-attention norm, MLP, residual:
LAYER_TYPES, checked against the installed transformers by tests/models/test_kept_rows.py) are swapped. The step
passes `kept_rows` ([1, T, 1] bool) through the model's keyword arguments, which transformers hands to every
decoder layer; without it the layer runs as before.
"""

from __future__ import annotations

from typing import Any

import torch

# Decoder layers whose forward body is LlamaDecoderLayer's (transformers 5.x).
LAYER_TYPES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                         "GemmaDecoderLayer", "SmolLM3DecoderLayer"})
_SWAPPED: dict[type, type] = {}


def _forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    """LlamaDecoderLayer.forward, with the MLP's input zeroed on the rows `kept_rows` leaves out.
    hidden_states [b, T, hidden]; kept_rows (keyword, optional) [1, T, 1] bool."""
    kept: torch.Tensor | None = kwargs.pop("kept_rows", None)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, cache=cache, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    if kept is not None:
        hidden_states = torch.where(kept, hidden_states, 0)  # exact zeros: rows the kernels skip
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def swap_last_layer(model: torch.nn.Module) -> bool:
    """Swap the class of the model's last decoder layer for one that reads `kept_rows`; False (nothing swapped)
    where the model has no `model.layers` or its layers are not LAYER_TYPES."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return False
    last = layers[-1]
    cls = type(last)
    if cls in _SWAPPED.values():
        return True
    if cls.__name__ not in LAYER_TYPES:
        return False
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"KeptRows{cls.__name__}", (cls,), {"forward": _forward})
    last.__class__ = _SWAPPED[cls]
    return True


def keeps_rows(cls: type) -> bool:
    """Whether `cls` is a swapped last layer (its forward reads `kept_rows`)."""
    return cls in _SWAPPED.values()


def kept_rows(tokens: int, keep: torch.Tensor) -> torch.Tensor:
    """[1, tokens, 1] bool: True at the `keep` indices ([R] long, into the step's token axis)."""
    kept = torch.zeros(tokens, dtype=torch.bool, device=keep.device).index_fill_(0, keep, True)
    return kept.view(1, tokens, 1)
