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

Mixed steps (CPU) call `bucketserve::mixed_attention`: their tokens come from several slots on one axis, and
the "mask" the graph passes is the step's [1, 1, T, 2] long tensor of (slot, position) per token. Runs of
more than SHORT_RUN tokens of one slot at consecutive positions are prompt pieces (causal over the slot up to
each position); every other token is a decoding row that sees its slot up to its own position, and consecutive
rows are attended as one decode batch; padding tokens (the spare slot) get zeros. Where bf16 runs on AMX tiles,
runs of 2..SHORT_RUN tokens (a verify step's row and its drafts) are pieces too, which the piece kernel hands to
models/csrc/run_attention.c: the run's tokens read their slot's K/V once, together.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from models import native_dispatch, native_library
from models.native import ATTENTION_DTYPES, decode_attention, decode_attention_masked, mask_extents, piece_attention

ATTENTION = "bucketserve_sdpa"
_registered = False
# How rows are split into SDPA calls, in units of one row-position of a batched call: measured with SmolLM2's
# bf16 layer shapes (one thread), a batch-8 SDPA costs ~0.085 us per row-position, one row alone ~0.06 us per
# position, and every call ~25 us inside this op (slicing, the call itself) = ~300 row-positions.
ROW_CALL_POSITIONS = 300
ROW_POSITION_COST = 0.7  # a lone row's position, relative to a batched one


@functools.lru_cache(maxsize=64)
def segments(extents: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Split rows into runs of consecutive rows, each attended in one SDPA call over its longest row
    (start, stop, positions): the runs minimising the modelled cost. One run for rows of similar length; a
    run per row when they are far apart (7 rows at 150, one at 1000). Cached: the 30 layers of a step ask with
    the same extents."""
    n = len(extents)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for stop in range(1, n + 1):
        longest = 0
        for start in range(stop - 1, -1, -1):
            longest = max(longest, extents[start])
            rows = stop - start
            cost = best[start] + rows * longest * (ROW_POSITION_COST if rows == 1 else 1.0) + ROW_CALL_POSITIONS
            if cost < best[stop]:
                best[stop], cut[stop] = cost, start
    runs = []
    stop = n
    while stop > 0:
        start = cut[stop]
        runs.append((start, stop, max(extents[start:stop])))
        stop = start
    return tuple(reversed(runs))


_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
_LIB.define("attention_general(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor")
_LIB.define("mixed_attention(Tensor query, Tensor key, Tensor value, Tensor meta, float scale) -> Tensor")
_LIB.define("mixed_attention_general(Tensor query, Tensor key, Tensor value, Tensor meta, float scale) -> Tensor")
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


class Call(NamedTuple):
    """One kernel (or SDPA) call of a mixed step: tokens [first, last). A prompt piece (`decoding` False) is one
    slot's tokens (slots[0]) at consecutive positions from extents[0]; a decoding call (`decoding` True) is one row
    per token, row i attending positions [0, extents[i]) of slot slots[i]: decoding rows, and the tokens of short
    runs (a verify step's row: its last token and its drafts), each a row that sees up to its own position."""

    first: int
    last: int
    slots: tuple[int, ...]
    extents: tuple[int, ...]
    decoding: bool


# A run of one slot's tokens at consecutive positions up to this long goes as decoding rows, one a token, unless the
# run kernel takes it (`runs`): measured with SmolLM2's bf16 shapes, a verify step of 16 rows of 4 tokens at position
# 300 spent 33 ms in 16 piece calls a layer, ~3x what the same tokens cost as 64 decoding rows (the piece kernel's
# tiles are made for long pieces); run_attention.c takes 16 such runs at ~300 positions in 585 us a layer, against
# 1073 as 64 decoding rows (docs/performance.md).
SHORT_RUN = 8


@functools.lru_cache(maxsize=256)
def mixed_plan(meta: bytes, spare: int, runs: bool = False) -> tuple[Call, ...]:
    """meta: the (slot, position) int64 pairs of a mixed step's tokens -> its calls (once per step: the 30 layers
    ask with the same bytes). Padding tokens (slot `spare`) are left out. `runs`: runs of 2..SHORT_RUN tokens are
    pieces (where the run kernel takes them). models/csrc/dispatch.cpp plans alike."""
    pairs = np.frombuffer(meta, dtype=np.int64).reshape(-1, 2).tolist()
    calls: list[Call] = []
    t, n = 0, len(pairs)
    while t < n:
        slot, pos = pairs[t]
        end = t + 1
        while end < n and pairs[end][0] == slot and pairs[end][1] == pairs[end - 1][1] + 1:
            end += 1
        last = calls[-1] if calls else None
        if slot == spare:
            pass
        elif end - t > (1 if runs else SHORT_RUN):
            calls.append(Call(t, end, (slot,), (pos,), False))
        else:
            rows, extents = (slot,) * (end - t), tuple(range(pos + 1, pos + 1 + end - t))
            if last is not None and last.decoding and last.last == t:
                calls[-1] = last._replace(last=end, slots=last.slots + rows, extents=last.extents + extents)
            else:
                calls.append(Call(t, end, rows, extents, True))
        t = end
    return tuple(calls)


def _slot_runs(slots: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) runs of rows on consecutive slots (s, s + 1, ...): what one SDPA call over slot buffers takes."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


@functools.lru_cache(maxsize=256)
def _row_mask(extents: tuple[int, ...], width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 1, 1, width] additive: row i sees positions [0, extents[i])."""
    seen = torch.arange(width).view(1, width) < torch.tensor(extents).view(-1, 1)
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf")).view(len(extents), 1, 1, width)


@functools.lru_cache(maxsize=64)
def _piece_mask(start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, start + n] additive: token i of a piece starting at position `start` sees positions [0, start + i].
    Additive in the query's dtype, not bool: SDPA would convert a bool mask on every call (8% of the call)."""
    seen = torch.arange(start + n).view(1, -1) <= torch.arange(start, start + n).view(-1, 1)
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))


def _mixed_attention_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """query [1, H, T, D]; key/value [S + 1, H_kv, C, D] (slot S: padding); meta [1, 1, T, 2] long (slot,
    position). Returns [1, H, T, D] (zeros at padding tokens)."""
    heads, dim, kv_heads = query.shape[1], query.shape[3], key.shape[1]
    out = torch.zeros_like(query)
    q, o = query[0], out[0]  # [H, T, D]
    # the piece kernel's tiles, which hand short runs to run_attention.c
    runs = query.dtype == torch.bfloat16 and native_library.available() and native_library.has("amx")
    for first, last, slots, ext, decoding in mixed_plan(meta.numpy().tobytes(), key.shape[0] - 1, runs):
        if not decoding:  # a prompt piece: causal over its slot, offset by its first position
            s0, p0, n = slots[0], ext[0], last - first
            if piece_attention(q[:, first:last], key[s0], value[s0], o[:, first:last], p0, scale):
                continue
            k, v = key[s0 : s0 + 1, :, : p0 + n], value[s0 : s0 + 1, :, : p0 + n]
            res = F.scaled_dot_product_attention(q[None, :, first:last], k, v,
                                                 attn_mask=None if p0 == 0 else _piece_mask(p0, n, query.dtype),
                                                 is_causal=p0 == 0, scale=scale, enable_gqa=heads != kv_heads)
            o[:, first:last] = res[0]
            continue
        # decoding rows: query heads of a KV group packed on the query axis, as in a decode step
        packed = q[:, first:last].transpose(0, 1).reshape(last - first, kv_heads, heads // kv_heads, dim)
        fast = decode_attention(packed, key, value, np.asarray(slots), np.asarray(ext), scale)
        if fast is not None:
            o[:, first:last] = fast.reshape(last - first, heads, dim).transpose(0, 1)
            continue
        for start, stop in _slot_runs(slots):
            s0 = slots[start] - start  # row r of the run reads slot s0 + r
            for a, b, w in segments(ext[start:stop]):
                a, b = a + start, b + start
                res = F.scaled_dot_product_attention(packed[a:b], key[s0 + a : s0 + b, :, :w],
                                                     value[s0 + a : s0 + b, :, :w],
                                                     attn_mask=_row_mask(ext[a:b], w, query.dtype), scale=scale)
                o[:, first + a : first + b] = res.reshape(b - a, heads, dim).transpose(0, 1)
    return out


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
native_dispatch.PY_CPU.impl("mixed_attention", _mixed_attention_cpu)  # until the C++ one replaces it
_LIB.impl("mixed_attention_general", _mixed_attention_cpu, "CPU")  # where the C++ kernel's path declines
torch.library.register_fake("bucketserve::attention", _attention_fake, lib=_LIB)
torch.library.register_fake("bucketserve::mixed_attention", _attention_fake, lib=_LIB)
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
