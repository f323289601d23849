"""Prompt-lookup (n-gram) speculative decoding, the pure part: which draft tokens a decoding row carries into a
step, and which of them the step's own greedy tokens confirm. Pure Python; the engine runs the verify step and
the scheduler (buckets/scheduler.py) asks `plan_drafts` for each step's drafts.

A draft is the k tokens that followed the latest earlier occurrence of the row's last n tokens (n = 3, 2, 1:
the longest that occurred before; one token after a match shorter than 3), in its prompt and output so far
(vLLM's `ngram` method, prompt lookup decoding). The step computes the row's last token and its drafts at their
positions, and greedy decoding keeps draft i while it equals the token the step predicted before it: a greedy
row's output is the one it would have decoded token by token, and a step gives it 1 + (accepted drafts) tokens.

k is the row's own: K (`--num-speculative-tokens`) at first, 2 more after a step that accepted all its drafts, 1
fewer after one that did not (1..FILL_DRAFTS_MOST); a step of decoding rows alone may give each row more, up to what
fills the token bucket it takes anyway (`fill_drafts`).

Which rows draft at all is each row's own too. A row keeps the chance that its next draft is accepted (a geometric
model: draft i yields a token with chance p**i), from its recent verify results and, while it carries no drafts, from
whether the draft it would have carried was the token its step gave (`observe`: free to know). A step's drafts are
those whose chance exceeds the step's threshold (buckets/draft_cost.py: what a token costs beside the step's own), so
a row that repeats itself drafts where one that does not carries none (`NgramIndex.worth`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from buckets.steps import Sequence
    from buckets.table import BucketTable

NGRAM_LONGEST = 3
NGRAM_SHORTEST = 1
# Drafts after a match shorter than NGRAM_LONGEST: on `make bench`'s prompts (scripts/ngram_acceptance.py, greedy
# bf16), a draft after a 3-token match was accepted 69-86% of the time, after a 1- or 2-token match 15-34%; a draft
# costs ~0.6 ms of a 16-row step (~44 ms), and an accepted one saves ~2.75 ms. So a short match proposes one.
SHORT_MATCH_DRAFTS = 1
# A verify step of few rows (1-3 at 8-16 tokens, the tail of a busy level, one client) has room in its token
# bucket for more drafts than K: its rows carry up to this many after a 3-token match (fill_drafts). Replayed on
# `make bench`'s outputs, 8 drafts give 1.85 tokens a step against K = 3's 1.69 (12: 1.86).
FILL_DRAFTS_MOST = 8
# A row's acceptance: decayed counts of drafts accepted and of drafts rejected (at most one a step: a verify step stops
# at its first wrong draft), each weighing this factor less at every later result, so a row that falls into a loop
# (or out of one) is seen within a few steps. Replayed on `make bench`'s greedy fp32 outputs at a 0.4 threshold
# (docs/performance.md, session 58), 0.7 had 754 drafts accepted against 0.9's 626, at the same 70% of those drafted.
ROW_DECAY = 0.7
# A new row's acceptance: one accepted and one rejected draft (p = 0.5) before anything is seen.
PRIOR_HITS = 1.0
PRIOR_MISSES = 1.0


class NgramIndex:
    """A row's tokens (prompt, then output) and, for each n-gram of up to NGRAM_LONGEST tokens, where the token
    after its latest occurrence sits. Built lazily, on the engine thread: the first `propose` indexes the prompt
    (a dict entry per token and n), every later one only the tokens appended since."""

    def __init__(self, prompt: tuple[int, ...] | list[int]) -> None:
        self.tokens: list[int] = list(prompt)
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 1  # tokens[j] for j < _indexed have been recorded as the successor of what precedes them
        self.k = 0  # the drafts this row carries at most (0: the scheduler's K), adapted by `verified`
        self.hits, self.misses = PRIOR_HITS, PRIOR_MISSES  # decayed accepted and rejected drafts (ROW_DECAY)

    def limit(self, k: int) -> int:
        return self.k or k

    @property
    def acceptance(self) -> float:
        """The chance that this row's next draft is accepted, given the drafts before it were."""
        return self.hits / (self.hits + self.misses)

    def verified(self, drafted: int, accepted: int, k: int) -> None:
        """A verify step accepted `accepted` of this row's `drafted` drafts: all of them, 2 more next time (up to
        FILL_DRAFTS_MOST), else 1 fewer (at least 1), from K = `k` at first (transformers' "heuristic" schedule
        for assisted generation). The acceptance counts the accepted drafts and the one rejected, if any."""
        now = self.limit(k)
        self.k = min(FILL_DRAFTS_MOST, now + 2) if accepted >= drafted else max(1, now - 1)
        if drafted > 0:
            self._count(max(0, min(accepted, drafted)), accepted < drafted)

    def observe(self, token: int) -> None:
        """A step gave this row `token` while it carried no drafts (call before `append`): whether the first draft it
        would have carried is that token counts as that draft's verify result, so a row that drafts nothing still
        measures what its drafts would yield."""
        draft = self.propose(1)
        if draft:
            self._count(int(draft[0] == token), draft[0] != token)

    def worth(self, threshold: float, k: int) -> int:
        """How many of up to k drafts have a chance above `threshold` of yielding a token: the largest m <= k with
        acceptance**m > threshold (0 where the acceptance is not above it; k where the threshold is 0 or less)."""
        p = self.acceptance
        if threshold <= 0.0 or p >= 1.0:
            return max(k, 0)
        if p <= threshold:
            return 0
        # p**m > threshold  <=>  m < log(threshold) / log(p) (both logs negative); the bound itself excluded
        bound = math.log(threshold) / math.log(p)
        m = math.ceil(bound) - 1
        return max(0, min(k, m))

    def _count(self, hits: int, missed: bool) -> None:
        self.hits = self.hits * ROW_DECAY + hits
        self.misses = self.misses * ROW_DECAY + int(missed)

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k draft tokens (fewer near the end of the match, none without one)."""
        tokens, table = self.tokens, self._next
        for j in range(self._indexed, len(tokens)):
            for n in range(NGRAM_SHORTEST, min(NGRAM_LONGEST, j) + 1):
                table[tuple(tokens[j - n : j])] = j
        self._indexed = max(self._indexed, len(tokens))
        if k <= 0:
            return ()
        for n in range(min(NGRAM_LONGEST, len(tokens)), NGRAM_SHORTEST - 1, -1):
            at = table.get(tuple(tokens[-n:]))
            if at is not None:
                return tuple(tokens[at : at + (k if n == NGRAM_LONGEST else min(k, SHORT_MATCH_DRAFTS))])
        return ()


def fill_drafts(k: int, rows: int, tokens: int) -> int:
    """Drafts a row may carry, whatever its own limit, in a step of `rows` decoding rows whose token bucket (the
    one rows x (1 + k) tokens take anyway) holds `tokens`: as many as fill it, up to FILL_DRAFTS_MOST; 0 where
    that is no more than k."""
    fill = min(FILL_DRAFTS_MOST, tokens // max(rows, 1) - 1)
    return fill if fill > k else 0


def plan_drafts(decode: tuple[Sequence, ...], k: int, room: int, context_length: int, fill: int = 0,
                threshold: float = 0.0) -> tuple[tuple[int, ...], ...]:
    """Drafts for each decoding row of a step (slot order), `room` draft tokens in all at most: up to the row's
    own limit (its `ngrams`' adapted k, else k) or `fill`, whichever is more, of which only those whose chance of
    yielding a token is above `threshold` (NgramIndex.worth; 0: all), for a row that speculates, never past its
    max_tokens (a verify step yields up to drafts + 1 tokens) nor past the context's last position. () when no row
    has one."""
    drafts: list[tuple[int, ...]] = []
    for seq in decode:
        if seq.ngrams is None:
            drafts.append(())
            continue
        m = min(seq.ngrams.worth(threshold, max(fill, seq.ngrams.limit(k))), room,
                seq.max_tokens - seq.num_generated - 1, context_length - 1 - seq.position)
        draft = seq.ngrams.propose(m) if m > 0 else ()
        room -= len(draft)
        drafts.append(draft)
    return tuple(drafts) if any(drafts) else ()


def accepted(first: int, drafts: tuple[int, ...], verified: list[int]) -> list[int]:
    """The tokens a verify step yields for one greedy row: `first` (its prediction at the row's last token), then
    verified[i] (its prediction at draft i) for as long as draft i equals the token predicted before it."""
    out = [first]
    for draft, token in zip(drafts, verified):
        if draft != out[-1]:
            break
        out.append(token)
    return out


def step_drafts(decode: tuple[Sequence, ...], k: int, table: BucketTable, fill: bool = False,
                room: int | None = None, threshold: float = 0.0) -> tuple[tuple[int, ...], ...]:
    """The drafts of a step's decoding rows (plan_drafts; () with K = 0), `room` draft tokens in all at most (None:
    the table's draft_rows), each with a chance above `threshold` of yielding a token: with `fill` (a step of
    decoding rows alone) a row's drafts may fill the token bucket that the rows and K drafts each take
    (fill_drafts); beside prompt pieces they stay at the rows' own limits, in what the prompts leave of the budget
    (the scheduler's `room`)."""
    if not k:
        return ()
    filled = fill_drafts(k, len(decode), table.verify_for(min(len(decode) * (1 + k), table.mixed_budget))) if fill else 0
    return plan_drafts(decode, k, table.draft_rows if room is None else min(room, table.draft_rows),
                       table.context_length, filled, threshold)
