"""The CPU kernel of `bucketserve::mixed_attention` (Python; models/csrc/dispatch.cpp has the C++ one, which plans
alike and hands what its path declines to `mixed_attention_general`, this kernel): a mixed step's tokens come from
several slots on one axis, and the "mask" the graph passes is the step's [1, 1, T, 2] long tensor of (slot, position)
per token. Runs of more than SHORT_RUN tokens of one slot at consecutive positions are prompt pieces (causal over the
slot up to each position); every other token is a decoding row that sees its slot up to its own position, and
consecutive rows are attended as one decode batch; padding tokens (the spare slot) get zeros. In bf16, runs of
2..SHORT_RUN tokens (a verify step's row and its drafts; 3.. without AMX) are pieces too, which the piece kernel hands
to models/csrc/run_attention.c (AMX tiles) or run_vec.c: the run's tokens read their slot's K/V once, together.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from models import native_dispatch, native_library
from models.native import decode_attention, decode_kernel, piece_attention
from models.row_segments import segments

_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("mixed_attention(Tensor query, Tensor key, Tensor value, Tensor meta, float scale) -> Tensor")
_LIB.define("mixed_attention_general(Tensor query, Tensor key, Tensor value, Tensor meta, float scale) -> Tensor")


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
# The shortest run that goes to SDPA as one piece where no kernel takes runs nor decoding rows (_mixed_attention_cpu).
SDPA_RUN = 2


@functools.lru_cache(maxsize=256)
def mixed_plan(meta: bytes, spare: int, runs: int = 0) -> tuple[Call, ...]:
    """meta: the (slot, position) int64 pairs of a mixed step's tokens -> its calls (once per step: the 30 layers
    ask with the same bytes). Padding tokens (slot `spare`) are left out. `runs` (0: none): runs of runs..SHORT_RUN
    tokens are pieces (where a run kernel takes them; native_library.shortest_run). models/csrc/dispatch.cpp plans
    alike."""
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
        elif end - t > SHORT_RUN or (runs and end - t >= runs):
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
    # the piece kernel hands short runs to run_attention.c (AMX tiles) or run_vec.c; where the decode kernel is off
    # (it loses to SDPA here: native.decode_kernel) a run of 2+ tokens (a row and its drafts) is one SDPA call under
    # its causal mask instead of a call a token (Zen 3 EPYC, fp32, one thread: 4 runs of 4 tokens at position 300
    # 0.82 ms a layer against 1.82, one run 0.24 against 0.63)
    runs = native_library.shortest_run() if query.dtype == torch.bfloat16 and native_library.available() else 0
    runs = runs or (0 if decode_kernel(query.dtype) else SDPA_RUN)
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


native_dispatch.PY_CPU.impl("mixed_attention", _mixed_attention_cpu)  # until the C++ one replaces it
_LIB.impl("mixed_attention_general", _mixed_attention_cpu, "CPU")  # where the C++ kernel's path declines
torch.library.register_fake("bucketserve::mixed_attention", lambda q, k, v, meta, scale: torch.empty_like(q), lib=_LIB)
