"""A static KV cache with one slot per row of the largest batch bucket and a write position per slot.

transformers' StaticLayer writes every row at one shared offset; continuous batching needs each slot at
its own position. So we keep our own storage and hand the stock models two thin `Cache` containers
(transformers calls `cache.update(k, v, layer_idx, ...)` generically, so no model class changes):

- `DecodeCache` (one per decode batch bucket b and KV-length bucket K): layers over the contiguous prefix
  views `storage[:b]` of every layer's (max_slots, H, C, D) tensor; `update` writes the one new token of
  row i at `write_pos[i]` (< K) and returns the whole buffers; attention reads only their first K
  positions (the width of the per-row 4-D mask the caller passes). Returning `[:, :, :K]` views of the
  buffers just written made inductor copy whole cache layers every step.
- `PrefillCache` (one per (rows P, length bucket L)): layers that copy the new K/V into a scratch
  buffer of shape (P, H, L, D) and return them unchanged (a new request has no past, so plain causal
  attention over L tokens). `commit` then copies each row's scratch into its slot, eagerly.

- `ChunkCache` (one per KV-length bucket K, for chunked prefill of one row): `update` writes the chunk's
  K/V into slot `slot` at positions [offset, offset + c) and returns that slot's first K positions; the
  caller passes a causal 4-D mask [1, 1, c, K] offset by `offset`.

- `MixedCache` (one per mixed token bucket T): tokens of any slots on one axis ([1, H, T, D]); `update` writes
  token t at (slot[t], position[t]) (padding tokens go to a spare slot no one reads) and returns the whole
  buffers; the attention op reads each token's slot up to its position (models/mixed_attention.py).

Every tensor a graph sees is a prefix view of a preallocated buffer (offset 0, fixed strides), so graphs
are keyed by shape only, and inductor updates the buffers in place instead of copying whole caches.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from models.cache_layout import kv_geometry, layer_types


class _ViewLayer(CacheLayerMixin):
    """Common part: a layer over tensors we allocated; never lazily initialised inside a graph."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys = keys
        self.values = values
        self.k: torch.Tensor = keys  # typed aliases (the base class declares keys/values Optional)
        self.v: torch.Tensor = values
        self.is_initialized = True
        self.device = keys.device
        self.dtype = keys.dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("slot cache layers are allocated up front")

    def get_seq_length(self) -> int:
        return 0  # no batch-wide length exists: callers always pass position_ids

    def get_max_length(self) -> int:
        return int(self.k.shape[2])


class DecodeLayer(_ViewLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write_pos: torch.Tensor, kv_length: int) -> None:
        super().__init__(keys, values)
        self.write_pos = write_pos  # [b] long, shared by all layers of one DecodeCache
        self.kv_length = kv_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [b, H, 1, D] -> written at [i, h, write_pos[i], :]. The cache is viewed as rows
        # [b * H * C, D] and written with index_copy_: inductor then updates the buffer in place, where a
        # scatter_ along dim 2 made it copy a whole cache layer per step (2.5x slower decode at b=8).
        b, h, _, d = key_states.shape
        context = self.k.shape[2]
        rows = torch.arange(b * h, device=key_states.device).view(b, h) * context + self.write_pos.view(b, 1)
        rows = rows.view(-1)
        self.k.view(b * h * context, d).index_copy_(0, rows, key_states.reshape(b * h, d))
        self.v.view(b * h * context, d).index_copy_(0, rows, value_states.reshape(b * h, d))
        # The whole buffers go back; attention reads their first K positions (the mask is [b, 1, 1, K]).
        return self.k, self.v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_length, 0

    def get_max_length(self) -> int:
        return self.kv_length


class PrefillLayer(_ViewLayer):
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [P, H, L, D]; stash for commit(), attend over the new tokens only.
        self.k.copy_(key_states)
        self.v.copy_(value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0


class ChunkLayer(_ViewLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor, offset: torch.Tensor,
                 kv_length: int) -> None:
        super().__init__(keys, values)  # the whole slot buffers [S, H, C, D]
        self.slot = slot  # [1] long, shared by all layers of one ChunkCache
        self.offset = offset  # [1] long
        self.kv_length = kv_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, H, c, D] -> written at [slot, h, offset + i, :] (rows of the [S * H * C, D] view,
        # in place as in DecodeLayer); returns [1, H, K, D]: the slot's first K positions, this chunk included.
        _, h, c, d = key_states.shape
        slots, _, context, _ = self.k.shape
        head = torch.arange(h, device=key_states.device).view(h, 1) * context
        pos = self.offset + torch.arange(c, device=key_states.device).view(1, c)
        rows = (self.slot * (h * context) + head + pos).view(-1)
        self.k.view(slots * h * context, d).index_copy_(0, rows, key_states.reshape(h * c, d))
        self.v.view(slots * h * context, d).index_copy_(0, rows, value_states.reshape(h * c, d))
        keys = self.k[:, :, : self.kv_length].index_select(0, self.slot)
        values = self.v[:, :, : self.kv_length].index_select(0, self.slot)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv_length, 0

    def get_max_length(self) -> int:
        return self.kv_length


class MixedLayer(_ViewLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> None:
        super().__init__(keys, values)  # the whole buffers [S + 1, H, C, D] (slot S: padding tokens)
        self.meta = meta  # [T, 2] long: (slot, position) per token, shared by all layers of one MixedCache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, H, T, D] -> token t at [slot[t], h, position[t], :] (rows of the [S * H * C, D] view,
        # in place as in DecodeLayer). Returns the whole buffers: the attention op knows what each token sees.
        _, h, t, d = key_states.shape
        slots, _, context, _ = self.k.shape
        head = torch.arange(h, device=key_states.device).view(1, h) * context
        rows = (self.meta[:, :1] * (h * context) + head + self.meta[:, 1:]).view(-1)  # [T * H], token-major
        self.k.view(slots * h * context, d).index_copy_(0, rows, key_states[0].transpose(0, 1).reshape(t * h, d))
        self.v.view(slots * h * context, d).index_copy_(0, rows, value_states[0].transpose(0, 1).reshape(t * h, d))
        return self.k, self.v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0


class MixedCache(Cache):
    def __init__(self, layers: list[MixedLayer], meta: torch.Tensor) -> None:
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.meta = meta

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class ChunkCache(Cache):
    def __init__(self, layers: list[ChunkLayer], slot: torch.Tensor, offset: torch.Tensor, kv_length: int) -> None:
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.slot = slot
        self.offset = offset
        self.kv_length = kv_length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class DecodeCache(Cache):
    def __init__(self, layers: list[DecodeLayer], write_pos: torch.Tensor, kv_length: int) -> None:
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.write_pos = write_pos
        self.kv_length = kv_length  # a Python int: each (batch, KV) bucket is its own cache and graph

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class PrefillCache(Cache):
    def __init__(self, layers: list[PrefillLayer]) -> None:
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.prefill_layers = layers


class SlotStorage:
    """Owns every K/V buffer: the slot cache [max_slots, H, C, D] per layer and a flat prefill scratch
    per layer big enough for the largest (rows, length) prefill graph."""

    def __init__(
        self,
        config: Any,
        *,
        max_slots: int,
        context_length: int,
        max_prefill_rows: int,
        max_prefill_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_size: int = 1,
        max_mixed_tokens: int = 0,
    ) -> None:
        self.num_layers, num_kv_heads, self.head_dim = kv_geometry(config)
        # Tensor parallel: each rank's k_proj / v_proj produce its share of the KV heads (the config keeps
        # the global count), so the cache holds H / tp heads.
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not divide by the tensor-parallel size {tp_size}")
        self.num_kv_heads = num_kv_heads // tp_size
        self.layer_types = layer_types(config)
        self.max_slots = max_slots
        self.context_length = context_length
        # Mixed steps write their padding tokens into one spare slot past the others (never read).
        self.spare_slot = max_slots if max_mixed_tokens else -1
        shape = (max_slots + (1 if max_mixed_tokens else 0), self.num_kv_heads, context_length, self.head_dim)
        # Zero-initialised: a NaN at a masked position would still poison softmax @ V (0 * NaN).
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        scratch = max_prefill_rows * self.num_kv_heads * max_prefill_length * self.head_dim
        self.scratch_keys = [torch.zeros(scratch, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.scratch_values = [torch.zeros(scratch, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.write_pos = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.chunk_slot = torch.zeros(1, dtype=torch.long, device=device)
        self.chunk_offset = torch.zeros(1, dtype=torch.long, device=device)
        self.mixed_meta = torch.zeros(max(max_mixed_tokens, 1), 2, dtype=torch.long, device=device)
        static = (self.write_pos, self.chunk_slot, self.chunk_offset, self.mixed_meta)
        for t in (*self.keys, *self.values, *self.scratch_keys, *self.scratch_values, *static):
            torch._dynamo.mark_static_address(t)

    def decode_cache(self, batch: int, kv_length: int) -> DecodeCache:
        """Cache over slots [0, batch), attending over positions [0, kv_length): decode runs the smallest
        batch bucket covering the highest busy slot and the smallest KV bucket covering the longest row."""
        if not 0 < kv_length <= self.context_length:
            raise ValueError(f"KV length {kv_length} is outside 1..{self.context_length}")
        pos = self.write_pos[:batch]
        layers = [DecodeLayer(k[:batch], v[:batch], pos, kv_length) for k, v in zip(self.keys, self.values)]
        return DecodeCache(layers, pos, kv_length)

    def chunk_cache(self, kv_length: int) -> ChunkCache:
        """Cache for one chunk of one row's prompt, attending over positions [0, kv_length) of its slot."""
        if not 0 < kv_length <= self.context_length:
            raise ValueError(f"KV length {kv_length} is outside 1..{self.context_length}")
        layers = [ChunkLayer(k, v, self.chunk_slot, self.chunk_offset, kv_length)
                  for k, v in zip(self.keys, self.values)]
        return ChunkCache(layers, self.chunk_slot, self.chunk_offset, kv_length)

    def mixed_cache(self, tokens: int) -> MixedCache:
        """Cache for a mixed step of `tokens` tokens (meta[:tokens] says where each goes)."""
        if self.spare_slot < 0 or tokens > self.mixed_meta.shape[0]:
            raise ValueError(f"no mixed cache of {tokens} tokens (storage sized for {self.mixed_meta.shape[0]})")
        meta = self.mixed_meta[:tokens]
        return MixedCache([MixedLayer(k, v, meta) for k, v in zip(self.keys, self.values)], meta)

    def prefill_cache(self, rows: int, length: int) -> PrefillCache:
        n = rows * self.num_kv_heads * length * self.head_dim
        shape = (rows, self.num_kv_heads, length, self.head_dim)
        layers = [
            PrefillLayer(k[:n].view(shape), v[:n].view(shape))
            for k, v in zip(self.scratch_keys, self.scratch_values)
        ]
        return PrefillCache(layers)

    def commit(self, cache: PrefillCache, slots: list[int], lengths: list[int]) -> None:
        """Copy each prefilled row's K/V (its real tokens only) from scratch into its slot. Eager, O(tokens)."""
        for layer, keys, values in zip(cache.prefill_layers, self.keys, self.values):
            for row, (slot, n) in enumerate(zip(slots, lengths)):
                keys[slot, :, :n].copy_(layer.k[row, :, :n])
                values[slot, :, :n].copy_(layer.v[row, :, :n])

    def copy_prefix(self, source: int, target: int, n: int) -> None:
        """Positions [0, n) of slot `source`'s K/V into slot `target` (prefix caching: a prompt that begins with
        what another slot holds). Eager, outside every graph: [H, n, D] per layer and buffer."""
        if not (0 <= source < self.max_slots and 0 <= target < self.max_slots and source != target
                and 0 < n <= self.context_length):
            raise ValueError(f"cannot copy {n} positions from slot {source} to slot {target}")
        for keys, values in zip(self.keys, self.values):
            keys[target, :, :n].copy_(keys[source, :, :n])
            values[target, :, :n].copy_(values[source, :, :n])
