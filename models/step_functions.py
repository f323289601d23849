"""The step functions a runner compiles, one per phase: what one graph call computes, from its inputs to its
logits (or sampled ids). Functions of (model, cache, inputs) with no state of their own: they write the step's
positions into the cache's index buffers and the model writes K/V into the slot buffers; the runner fills the
inputs, picks the cache of the graph key, and calls them compiled (models/graph_set.py).

Shapes at the boundaries are given per function; every shape is static for a graph key (the bucket table's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from models.kept_rows import kept_rows
from models.masks import chunk_mask, decode_mask
from models.sample_graph import SampleInputs, sample_rows
from models.slot_cache import ChunkCache, DecodeCache, MixedCache, PrefillCache


@dataclass(frozen=True)
class PrefillRow:
    """A prompt to prefill: its tokens go to positions 0.. of `slot`."""

    slot: int
    token_ids: list[int]


def prefill_step(
    model: torch.nn.Module, cache: PrefillCache, input_ids: torch.Tensor, last_idx: torch.Tensor
) -> torch.Tensor:
    """input_ids: [P, L] right-padded; last_idx: [P, 1] index of each row's last real token.
    Returns logits [P, V] at those positions (the lm_head runs on P rows, not P * L)."""
    rows, length = input_ids.shape
    position_ids = torch.arange(length, device=input_ids.device).view(1, length).expand(rows, length)
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=last_idx)
    logits: torch.Tensor = out.logits[:, 0]
    return logits


# Model types whose forward does nothing with input_ids but embed them (`inputs_embeds = embed_tokens(input_ids)`,
# transformers 5.x), so inputs_embeds give the same model. Others (Gemma3n's per-layer inputs, Falcon-H1's and
# Pegasus's embedding multipliers on the input_ids branch, ...) keep input_ids and compute their free rows.
ZEROABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text",
                                  "phi3", "granite", "olmo2", "gpt2"})


def zeroes_free_rows(config: Any) -> bool:
    """Whether the decode and mixed graphs of this model zero their free rows (see _decode_step)."""
    return getattr(config, "model_type", None) in ZEROABLE_MODEL_TYPES


def _inputs(model: torch.nn.Module, input_ids: torch.Tensor, live: torch.Tensor, zero: bool) -> dict[str, Any]:
    """The model's token inputs for input_ids [b, t]: with `zero`, inputs_embeds [b, t, hidden] that are zero where
    `live` (bool, broadcast to [b, t, 1]) is False, rows that compute nothing; else the ids themselves."""
    if not zero:
        return {"input_ids": input_ids}
    embedding: Callable[[torch.Tensor], torch.Tensor] = model.get_input_embeddings()  # type: ignore[operator]
    embeds = embedding(input_ids)
    return {"inputs_embeds": embeds * live.to(embeds.dtype)}


def make_decode_step(dtype: torch.dtype, kinds: list[str], window: int | None, zero_free_rows: bool = True
                     ) -> Callable[..., torch.Tensor]:
    def _decode_step(
        model: torch.nn.Module, cache: DecodeCache, input_ids: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """input_ids: [b, 1]; pos: [b] per-slot write positions (< cache.kv_length), -1 for a row that computes
        nothing (a free slot: it runs at position 0 with its hidden state zeroed). Returns logits [b, V].

        Why zero a free row: from its embedding on, a zero row stays zero through a model without biases or
        LayerNorm shifts (RMSNorm, rotary, attention over its one zero K/V, the MLP all map 0 to 0), and the CPU
        kernels skip zero rows (models/csrc/dispatch.cpp): a batch bucket's free slots cost nearly nothing instead
        of a full row each. Where a model does map 0 elsewhere the row is merely computed, as before; where its
        forward takes input_ids otherwise than through the embedding (`zero_free_rows` False: zeroes_free_rows),
        the free row runs as token 0 at position 0, computed."""
        live = (pos >= 0).view(-1, 1, 1)  # [b, 1, 1]
        pos = pos.clamp(min=0)
        cache.write_pos.copy_(pos)
        mask = decode_mask(pos, cache.kv_length, dtype, kinds, window)
        out = model(**_inputs(model, input_ids, live, zero_free_rows), position_ids=pos.view(-1, 1),
                    attention_mask=mask, cache=cache, use_cache=True)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    return _decode_step


def make_chunk_step(dtype: torch.dtype, kinds: list[str], window: int | None) -> Callable[..., torch.Tensor]:
    def _chunk_step(
        model: torch.nn.Module, cache: ChunkCache, input_ids: torch.Tensor, slot: torch.Tensor,
        offset: torch.Tensor, last_idx: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids: [1, c] (right-padded chunk); slot, offset: [1] long; last_idx: [1, 1] index of the
        chunk's last real token. Returns logits [1, V] there (used only when the chunk ends the prompt)."""
        cache.slot.copy_(slot)
        cache.offset.copy_(offset)
        chunk = input_ids.shape[1]
        positions = (offset.view(1, 1) + torch.arange(chunk, device=input_ids.device).view(1, chunk))
        mask = chunk_mask(offset, chunk, cache.kv_length, dtype, kinds, window)
        out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                    logits_to_keep=last_idx)
        logits: torch.Tensor = out.logits[:, 0]
        return logits

    return _chunk_step


def make_mixed_step(zero_free_rows: bool = True, kept: bool = False) -> Callable[..., torch.Tensor]:
    def _mixed_step(model: torch.nn.Module, cache: MixedCache, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [1, T] tokens of several slots on one axis, position -1 for a padding token (its
        hidden state zeroed as a decode step's free rows are, where the model allows: the CPU kernels skip it);
        meta: [T, 2] (slot, position) per token; keep: [R] indices of the tokens whose logits are wanted. Returns
        logits [R, V]. The meta tensor goes in as the 4-D "mask" (transformers passes 4-D masks through
        untouched): the attention op reads it (and gives padding tokens, those of the spare slot, zeros). With
        `kept`, the last layer's MLP runs on the kept tokens alone (models/kept_rows.py)."""
        cache.meta.copy_(meta)
        mask = cache.meta.view(1, 1, -1, 2)
        live = (positions >= 0).unsqueeze(-1)  # [1, T, 1]
        extra = {"kept_rows": kept_rows(input_ids.shape[1], keep)} if kept else {}
        out = model(**_inputs(model, input_ids, live, zero_free_rows), position_ids=positions.clamp(min=0),
                    attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=keep, **extra)
        logits: torch.Tensor = out.logits[0]
        return logits

    return _mixed_step


def sample_step(model: torch.nn.Module, logits: torch.Tensor, inputs: SampleInputs) -> tuple[torch.Tensor, ...]:
    """The sampling graph (model unused: every step function takes it first)."""
    return sample_rows(logits, inputs)


def vocab_size(model: Any) -> int:
    """Width of the logits: the output embedding's rows (the config's vocab_size when there is none)."""
    out = model.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)
