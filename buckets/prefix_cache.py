"""Prefix caching over static slots: what each free slot's K/V still holds, and which free slot a new prompt
should take to skip the most of its prefill.

Why: the slot cache is preallocated per slot, and a finished request's K/V stays in its slot until another
request overwrites it. A new prompt that begins with the same tokens (a shared system prompt, the next turn of
a conversation that repeats the earlier turns and the model's answer) can take that slot and start its prefill
where the match ends: the positions before it already hold exactly the K/V it would compute (same tokens at the
same positions). vLLM keeps a hash table of 16-token blocks for the same purpose; a slot here is one contiguous
sequence, so a match is a common prefix, found by comparing the prompt with each free slot's tokens.

Pure Python, no torch: the scheduler (buckets/scheduler.py) owns one and tells it when a slot is taken and what
a slot holds when it is freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Matches shorter than this are not worth taking a slot out of lowest-first order for: a higher slot can keep a
# larger decode batch bucket running for the request's whole life, and a few tokens of prefill cost little.
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
    """The tokens whose K/V each free slot holds at positions [0, len) (a running slot holds nothing reusable
    until it is freed again). `limit`: the most positions a slot may claim; position context - 1 is excluded
    because a decode step's free rows write their dummy K/V there (models/slot_cache.py, DecodeLayer)."""

    limit: int
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> token ids at positions 0..n-1

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"the prefix limit must be positive, got {self.limit}")

    def release(self, slot: int, tokens: tuple[int, ...]) -> None:
        """`slot` was freed holding the K/V of `tokens` at positions 0..len - 1."""
        tokens = tokens[: self.limit]
        if tokens:
            self.held[slot] = tokens
        else:
            self.held.pop(slot, None)

    def take(self, slot: int) -> None:
        """`slot` now belongs to a request: whatever it held is being overwritten from the match on."""
        self.held.pop(slot, None)

    def best(self, prompt: tuple[int, ...], free: list[int]) -> tuple[int, int]:
        """(slot, tokens to reuse) for `prompt` among the free slots: the longest match of at least MIN_MATCH
        tokens, the lowest slot on ties; (-1, 0) when none. At most len(prompt) - 1 tokens are reused: the
        prompt's last token must run to give its logits."""
        best_slot, best_n = -1, 0
        cap = len(prompt) - 1
        for slot in free:
            held = self.held.get(slot)
            if held is None:
                continue
            n = min(common_prefix(held, prompt), cap)
            if n >= MIN_MATCH and n > best_n:
                best_slot, best_n = slot, n
        return best_slot, best_n
