"""A mixed step's inputs on one token axis, as ModelRunner.mixed takes them: the decoding rows first (each its last
token, then its drafts), then each prompt piece; which tokens' logits the graph returns, in which rows."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from buckets.scheduler import MixedStep
from buckets.table import BucketTable


class MixedInputs(NamedTuple):
    ids: list[int]  # [n] token ids (n <= the step's token bucket; the runner pads)
    positions: list[int]  # [n] each token's position in its slot
    slots: list[int]  # [n] each token's slot
    keep: list[int]  # the token whose logits make each graph row (-1: a padding row)
    rows: int  # the graph's logit rows: the max batch, or a verify graph's max batch + draft rows
    sampled: int  # rows 0..sampled-1 sample: the decoding rows, then the pieces that end their prompt
    drafts: int  # a verify step's draft tokens, whose logits follow the max batch's rows


def mixed_inputs(step: MixedStep, prompt_of: Callable[[str], list[int]], table: BucketTable) -> MixedInputs:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    keep: list[int] = []
    extra: list[int] = []  # the draft tokens' indices
    for i, seq in enumerate(step.decode):
        drafts = step.drafts[i] if step.drafts else ()
        keep.append(len(ids))
        extra += range(len(ids) + 1, len(ids) + 1 + len(drafts))
        ids += (seq.last_token, *drafts)
        positions += range(seq.position, seq.position + 1 + len(drafts))
        slots += [seq.slot] * (1 + len(drafts))
    for piece in step.pieces:
        ids += prompt_of(piece.seq.request_id)[piece.offset : piece.offset + piece.num_tokens]
        positions += range(piece.offset, piece.offset + piece.num_tokens)
        slots += [piece.seq.slot] * piece.num_tokens
        if piece.is_final:
            keep.append(len(ids) - 1)
    sampled = len(keep)
    if step.drafts:
        keep += [-1] * (table.max_batch - sampled) + extra
    return MixedInputs(ids, positions, slots, keep, table.verify_rows if step.drafts else table.max_batch, sampled,
                       len(extra))
