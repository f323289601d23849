"""What the scheduler hands the engine: a sequence's scheduling state and the four kinds of step (one graph
call each). Pure data: the scheduler (buckets/scheduler.py) makes them, the engine runs them, the metrics count
their padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from buckets.speculation import NgramIndex


@dataclass(eq=False)
class Sequence:
    """One request's scheduling state. `position` is where its next token's K/V will be written."""

    request_id: str
    prompt_len: int
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    bucket: int = 0
    slot: int = -1
    position: int = 0
    prefilled: int = 0  # prompt tokens already in the slot's cache (< prompt_len while chunking)
    num_generated: int = 0
    last_token: int = -1
    finish_reason: str | None = None
    num_chunks: int = 0  # prefill graph calls this prompt took (1 unless chunked)
    # Prefix caching (buckets/prefix_cache.py): the prompt's ids (empty: nothing to match or keep), the ids
    # sampled so far, and how many prompt tokens the slot already held when the request took it.
    prompt_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    cached: int = 0
    # Speculative decoding (buckets/speculation.py): the row's n-gram index when it may carry drafts (greedy,
    # no logprobs, no penalties), else None.
    ngrams: NgramIndex | None = None

    @property
    def is_decoding(self) -> bool:
        return self.prefilled >= self.prompt_len

    def advance(self, token: int, context_length: int) -> bool:
        """Record a generated token; whether it ends the sequence (a stop id, max_tokens, the context's end)."""
        self.last_token = token
        if self.prompt_ids:  # kept only where a slot's tokens may be reused
            self.output_ids.append(token)
        if self.ngrams is not None:
            self.ngrams.append(token)
        self.num_generated += 1
        self.position = self.prompt_len + self.num_generated - 1  # where this token's K/V will go
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_tokens or self.position >= context_length:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def held_tokens(self) -> tuple[int, ...]:
        """The tokens whose K/V this sequence's slot holds at positions 0..n-1 (what a later prompt may reuse):
        the prompt so far while it is prefilled, then the prompt and every sampled token but the last (whose
        K/V the next step would write)."""
        if not self.prompt_ids:
            return ()
        if not self.is_decoding:
            return self.prompt_ids[: self.prefilled]
        return (self.prompt_ids + tuple(self.output_ids))[: self.position]


@dataclass(frozen=True)
class PrefillStep:
    """Prefill rows from position 0: whole prompts, or the first chunk (`length` tokens) of a longer one."""

    length: int  # length bucket
    batch: int  # prefill batch bucket (>= len(seqs))
    seqs: tuple[Sequence, ...]

    @property
    def padding_tokens(self) -> int:
        """Tokens computed for padding: the gap to the bucket per real row plus whole pad rows."""
        real = sum(min(s.prompt_len, self.length) for s in self.seqs)
        return self.length * self.batch - real

    @property
    def sampling_seqs(self) -> tuple[Sequence, ...]:
        """The rows whose prompt ends in this step: they get their first token from it."""
        return tuple(s for s in self.seqs if s.prompt_len <= self.length)

    def prefilled(self, seq: Sequence) -> int | None:
        """How much of `seq`'s prompt is in its slot after this step (None: the step decoded it)."""
        return min(seq.prompt_len, self.length)


@dataclass(frozen=True)
class ChunkStep:
    """One chunk of a long prompt: tokens [offset, offset + num_tokens) into its slot, padded to `length`
    (the chunk length), attending over the slot's positions [0, kv)."""

    length: int
    kv: int
    offset: int
    num_tokens: int
    seq: Sequence

    @property
    def seqs(self) -> tuple[Sequence, ...]:
        return (self.seq,)

    @property
    def is_final(self) -> bool:
        return self.offset + self.num_tokens >= self.seq.prompt_len

    @property
    def sampling_seqs(self) -> tuple[Sequence, ...]:
        return (self.seq,) if self.is_final else ()

    @property
    def padding_tokens(self) -> int:
        return self.length - self.num_tokens

    def prefilled(self, seq: Sequence) -> int | None:
        return self.offset + self.num_tokens


@dataclass(frozen=True)
class DecodeStep:
    batch: int  # decode batch bucket; rows are slots [0, batch)
    kv: int  # KV-length bucket: attention reads positions [0, kv) of each slot
    seqs: tuple[Sequence, ...]
    # (slot, position) of rows inside the batch whose prompt is still being chunked: their dummy token is
    # written at the slot's first unfilled position, which its next chunk overwrites before anything reads it.
    parked: tuple[tuple[int, int], ...] = ()

    @property
    def padding_rows(self) -> int:
        return self.batch - len(self.seqs)

    @property
    def sampling_seqs(self) -> tuple[Sequence, ...]:
        return self.seqs

    def prefilled(self, seq: Sequence) -> int | None:
        return None


@dataclass(frozen=True)
class Piece:
    """Prompt tokens [offset, offset + num_tokens) of `seq` in a mixed step."""

    seq: Sequence
    offset: int
    num_tokens: int

    @property
    def is_final(self) -> bool:
        return self.offset + self.num_tokens >= self.seq.prompt_len


@dataclass(frozen=True)
class MixedStep:
    """Decoding rows and prompt pieces on one token axis, padded to the token bucket `tokens`: first each row of
    `decode` (slot order: its last token, then its drafts), then each piece's tokens, then padding."""

    tokens: int  # mixed token bucket
    decode: tuple[Sequence, ...]
    pieces: tuple[Piece, ...]
    # Prefix caching: (from slot, to slot, n): copy K/V positions [0, n) before the step runs, in this order.
    copies: tuple[tuple[int, int, int], ...] = ()
    # Speculative decoding: the draft tokens of each row of `decode` (() for none at all: a plain mixed step).
    # The step then runs the verify graph of its bucket, which returns the logits at the drafts too.
    drafts: tuple[tuple[int, ...], ...] = ()

    @property
    def num_drafts(self) -> int:
        return sum(len(d) for d in self.drafts)

    @property
    def seqs(self) -> tuple[Sequence, ...]:
        return self.decode + tuple(p.seq for p in self.pieces)

    @property
    def sampling_seqs(self) -> tuple[Sequence, ...]:
        """Decoding rows, then the pieces that end their prompt (in that order in the step's logits)."""
        return self.decode + tuple(p.seq for p in self.pieces if p.is_final)

    @property
    def prompt_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pieces)

    @property
    def padding_tokens(self) -> int:
        return self.tokens - len(self.decode) - self.num_drafts - self.prompt_tokens

    def prefilled(self, seq: Sequence) -> int | None:
        return next((p.offset + p.num_tokens for p in self.pieces if p.seq is seq), None)


Step = PrefillStep | ChunkStep | DecodeStep | MixedStep
