"""Prefix caching over static slots: what each free slot's K/V still holds, and where a new prompt's prefill
can start.

Why: the slot cache is preallocated per slot, and a finished request's K/V stays in its slot until another
request overwrites it. A new prompt that begins with the same tokens (a shared system prompt, the next turn of
a conversation that repeats the earlier turns and the model's answer) needs no K/V computed for them: the
positions of the match hold exactly the K/V it would compute (same tokens at the same positions). vLLM keeps a
hash table of 16-token blocks for the same purpose; a slot here is one contiguous sequence, so a match is a
common prefix, found by comparing the prompt with each candidate slot's tokens: the free slots' (what they held
when freed) and the running requests' (what they have computed so far). Where the match lies in another slot,
its K/V positions are copied into the prompt's before the step runs (a few MB: far less than computing them).

Which free slot a prompt takes (`SlotPrefixes.place`): among those that keep the decode batch bucket where
the lowest free slot would (small buckets), the slot of its own match (no copy), else one that holds nothing, else
the one freed longest ago (least recently used, as vLLM evicts blocks). Taking the lowest free slot regardless
would overwrite the conversation that just ended there, the one most likely to send its next turn.

Pure Python, no torch: the scheduler (buckets/scheduler.py) owns one and tells it when a slot is taken and what
a slot holds when it is freed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from buckets.steps import Sequence

# Matches shorter than this are not reused: a few tokens of prefill cost less than the copy's fixed cost.
MIN_MATCH = 16


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case of a full match, at C speed
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class SlotPrefixes:
    """The tokens whose K/V each free slot holds at positions [0, len) (a running slot's are its sequence's
    held_tokens()). `limit`: the positions a slot has. A step that writes a free slot makes the scheduler forget
    its record: a decode step computes its free rows at position 0 of their slots (models/step_functions.py)."""

    limit: int
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> token ids at positions 0..n-1

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"the prefix limit must be positive, got {self.limit}")

    def release(self, slot: int, tokens: tuple[int, ...]) -> None:
        """`slot` was freed holding the K/V of `tokens` at positions 0..len - 1."""
        tokens = tokens[: self.limit]
        self.held.pop(slot, None)  # re-inserted last: `held` iterates from the record freed longest ago
        if tokens:
            self.held[slot] = tokens

    def place(self, prompt: tuple[int, ...], room: list[int], free: list[int], running: Mapping[int, Sequence]
              ) -> tuple[int, int, int]:
        """(slot, source slot, tokens to reuse) for a new prompt: the slot it takes among the free slots in `room`
        (ascending, a subset of `free`) is its match's own (no copy), else victim(room); the match is source()'s
        over every free slot and running request ((-1, 0): none)."""
        source, n = self.source(prompt, free[0], free[1:], running)
        return (source if source in room else self.victim(room)), source, n

    def victim(self, slots: list[int]) -> int:
        """Of these free slots (ascending), the one a prompt overwrites when it reuses none of them: the lowest that
        holds nothing, else the one freed longest ago."""
        empty = [s for s in slots if s not in self.held]
        if empty:
            return empty[0]
        age = {s: i for i, s in enumerate(self.held)}
        return min(slots, key=age.__getitem__)

    def forget(self, slot: int) -> None:
        """`slot` holds nothing to reuse: a request took it (and overwrites it), or a step that wrote it failed."""
        self.held.pop(slot, None)

    def source(self, prompt: tuple[int, ...], slot: int, free: list[int], running: Mapping[int, Sequence]
               ) -> tuple[int, int]:
        """(source slot, tokens to reuse) for `prompt`, which takes `slot`: among the free slots (`slot`
        included), by what they held when freed, and the running requests, by what they have computed so far
        (their positions before it stay as they are while they run). (-1, 0) when nothing matches."""
        if not prompt:
            return -1, 0
        candidates = {s: self.held[s] for s in (slot, *free) if s in self.held}
        candidates.update((s, q.held_tokens()) for s, q in running.items() if q.prompt_ids and q.prefilled)
        return best_match(prompt, candidates, slot)


def best_match(prompt: tuple[int, ...], candidates: Mapping[int, tuple[int, ...]], prefer: int) -> tuple[int, int]:
    """(slot, tokens to reuse) for `prompt` among candidate slots (slot -> the tokens it holds): the longest match
    of at least MIN_MATCH tokens, `prefer` (the slot the prompt will take: no copy) then the lowest slot on ties;
    (-1, 0) when none. At most len(prompt) - 1 tokens are reused: the prompt's last token must run to give its
    logits."""
    best_slot, best_n = -1, 0
    cap = len(prompt) - 1
    for slot in sorted(candidates, key=lambda s: (s != prefer, s)):
        n = min(common_prefix(candidates[slot], prompt), cap)
        if n >= MIN_MATCH and n > best_n:
            best_slot, best_n = slot, n
    return best_slot, best_n
