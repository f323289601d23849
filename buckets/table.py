"""The bucket table: the one place that defines every static shape the server may run.

Compilation, routing, warm-up and metric labels all iterate over a `BucketTable` (its defaults live in
buckets/defaults.py); nothing else in the code base writes a size literal. Pure Python (no torch) so it can be
tested in milliseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from buckets import table_file
from buckets.defaults import DEFAULT_MIN_LENGTH, MIN_VERIFY_TOKENS, MIXED_TOKEN_BUDGET, default_kv_lengths
from buckets.errors import BatchTooLargeError, BucketError, PromptTooLongError
from buckets.graph_key import GraphKey, Phase
from buckets.sizes import parse_sizes, powers_of_two, smallest_at_least, validate_sizes

__all__ = ["BatchTooLargeError", "BucketError", "BucketTable", "GraphKey", "Phase", "PromptTooLongError", "parse_sizes",
           "powers_of_two"]

@dataclass(frozen=True)
class BucketTable:
    """Sorted prompt-length buckets, decode batch buckets, prefill batch buckets and decode KV-length
    buckets, plus the static context length of the KV cache (every slot holds up to `context_length` tokens).

    A decode step runs the smallest KV bucket covering the longest live row (its position + 1): attention
    then reads only that prefix of each slot, so a step costs what the sequences hold, not the context.

    With `chunked_prefill`, the largest length bucket is the chunk length c: a longer prompt is prefilled c
    tokens at a time (the first chunk by the prefill graph of bucket c, the others by chunk graphs that
    attend over the slot's earlier positions), interleaved with decode steps. Its request bucket is its
    length rounded up to a multiple of c, so `request_lengths` stays bounded.

    With `mixed_tokens` (token buckets; () = off), a step can carry every decoding row (one token each) and
    prompt tokens of new or partly prefilled requests together, packed on one token axis and padded to the
    smallest token bucket that holds them: one pass over the weights serves both (what vLLM schedules). Its
    graph returns the logits of `max_batch` rows (a row per slot at most samples in one step). With rows
    decoding a step carries up to `mixed_budget` tokens (the largest token bucket up to `max_step_tokens`); without,
    up to `solo_budget` (the largest bucket), and with them too where the scheduler's `waiting_served_ratio` says
    the waiting outnumber them. With `draft_rows` (speculative decoding; 0 = off), each mixed token bucket up to
    the mixed budget also has a verify graph, which returns `draft_rows` more logit rows: those of the draft
    tokens that the step's decoding rows carry after their last token."""

    lengths: tuple[int, ...]
    batch_sizes: tuple[int, ...] = (1,)
    prefill_batch_sizes: tuple[int, ...] = (1,)
    context_length: int = 0  # 0: the largest length bucket
    kv_lengths: tuple[int, ...] = ()  # (): default_kv_lengths(context_length); the last is the context
    chunked_prefill: bool = False
    mixed_tokens: tuple[int, ...] = ()
    max_step_tokens: int = 0  # 0: the chunk length (MIXED_TOKEN_BUDGET without chunking)
    draft_rows: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(self.lengths))
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "prefill_batch_sizes", tuple(self.prefill_batch_sizes))
        validate_sizes("lengths", self.lengths)
        validate_sizes("batch_sizes", self.batch_sizes)
        validate_sizes("prefill_batch_sizes", self.prefill_batch_sizes)
        if self.prefill_batch_sizes[-1] > self.batch_sizes[-1]:
            raise BucketError(
                f"prefill_batch_sizes {list(self.prefill_batch_sizes)} exceed the largest batch size "
                f"{self.batch_sizes[-1]}"
            )
        if self.context_length == 0:
            object.__setattr__(self, "context_length", self.lengths[-1])
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int):
            raise BucketError(f"context_length must be an integer, got {self.context_length!r}")
        if self.context_length < self.lengths[-1]:
            raise BucketError(
                f"context_length {self.context_length} is smaller than the largest length bucket "
                f"{self.lengths[-1]}"
            )
        kv = tuple(self.kv_lengths) or default_kv_lengths(self.context_length)
        object.__setattr__(self, "kv_lengths", kv)
        validate_sizes("kv_lengths", kv)
        if kv[-1] != self.context_length:
            raise BucketError(
                f"kv_lengths {list(kv)} must end at the context length {self.context_length} "
                "(every live sequence needs a decode graph)"
            )
        object.__setattr__(self, "mixed_tokens", tuple(self.mixed_tokens))
        if isinstance(self.max_step_tokens, bool) or not isinstance(self.max_step_tokens, int) \
                or self.max_step_tokens < 0:
            raise BucketError(f"max_step_tokens must be an integer >= 0 (0: the chunk length), got "
                              f"{self.max_step_tokens!r}")
        if self.mixed_tokens:
            validate_sizes("mixed_tokens", self.mixed_tokens)
            if self.mixed_budget <= self.max_batch or self.mixed_tokens[-1] > self.context_length:
                raise BucketError(
                    f"the mixed token budget {self.mixed_budget} must exceed the largest batch bucket "
                    f"{self.max_batch} (every decoding row plus a prompt token), and the largest mixed token "
                    f"bucket {self.mixed_tokens[-1]} fit the context {self.context_length}"
                )
        if isinstance(self.draft_rows, bool) or not isinstance(self.draft_rows, int) or self.draft_rows < 0 or (
                self.draft_rows and self.max_batch + self.draft_rows > self.mixed_budget):
            raise BucketError(f"draft_rows must be an integer >= 0 (0: no speculative decoding) and, with every "
                              f"decoding row, fit the mixed token budget {self.mixed_budget}: got {self.draft_rows!r}")
        if self.chunked_prefill and self.context_length % self.max_length:
            raise BucketError(
                f"chunked prefill needs the context length {self.context_length} to be a multiple of the chunk "
                f"length (the largest length bucket, {self.max_length})"
            )

    # -- routing -------------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def chunk_length(self) -> int:
        """Tokens per prefill chunk; 0 when chunked prefill is off."""
        return self.max_length if self.chunked_prefill else 0

    @property
    def request_lengths(self) -> tuple[int, ...]:
        """Every request bucket (metric labels): the length buckets, then multiples of the chunk length."""
        c = self.chunk_length
        return self.lengths + (tuple(range(2 * c, self.context_length + 1, c)) if c else ())

    @property
    def chunk_kv_lengths(self) -> tuple[int, ...]:
        """KV buckets a chunk graph may need: a chunk after the first reaches past position c. None with
        mixed steps: they carry every later piece of a prompt."""
        if not self.chunk_length or self.mixed_tokens:
            return ()
        return tuple(kv for kv in self.kv_lengths if kv > self.chunk_length)

    @property
    def mixed_budget(self) -> int:
        """Most tokens one mixed step carries while rows decode (0: mixed steps off): the largest token bucket
        up to `max_step_tokens` (0: the chunk length, MIXED_TOKEN_BUDGET without chunking), so a decoding row waits
        about one such step."""
        cap = self.max_step_tokens or self.chunk_length or MIXED_TOKEN_BUDGET
        within = [n for n in self.mixed_tokens if n <= cap]
        return within[-1] if within else (self.mixed_tokens[0] if self.mixed_tokens else 0)

    @property
    def solo_budget(self) -> int:
        """Most prompt tokens one mixed step carries when no row decodes (nobody waits on it; or, with the
        scheduler's `waiting_served_ratio`, when the waiting outnumber the decoding rows): the largest token
        bucket. Above the mixed budget, a long prompt at an idle server takes fewer, larger steps (each step
        reads the weights once; matmuls of 1024 rows run faster per row than four of 256)."""
        return self.mixed_tokens[-1] if self.mixed_tokens else 0

    @property
    def verify_tokens(self) -> tuple[int, ...]:
        """Token buckets of verify graphs (GraphKey("verify", verify_rows, tokens)): the mixed token buckets a step
        with decoding rows may take, and below the smallest, powers of two from MIN_VERIFY_TOKENS (a few rows and
        their drafts)."""
        if not self.draft_rows:
            return ()
        small = powers_of_two(MIN_VERIFY_TOKENS, self.mixed_tokens[0] // 2) if self.mixed_tokens[0] > MIN_VERIFY_TOKENS \
            else ()
        return small + tuple(n for n in self.mixed_tokens if n <= self.mixed_budget)

    def verify_for(self, tokens: int) -> int:
        """Smallest verify token bucket holding `tokens` tokens."""
        return smallest_at_least(self.verify_tokens, tokens)

    @property
    def verify_rows(self) -> int:
        """Logit rows of a verify graph: a row per slot, then one per draft token."""
        return self.max_batch + self.draft_rows

    def mixed_for(self, tokens: int) -> int:
        """Smallest mixed token bucket holding `tokens` tokens."""
        return smallest_at_least(self.mixed_tokens, tokens)

    @property
    def sample_batch_sizes(self) -> tuple[int, ...]:
        """Row counts of the logits a step can return: decode batch buckets and prefill batch buckets."""
        return tuple(sorted(set(self.batch_sizes) | set(self.prefill_batch_sizes)))

    def length_for(self, n: int) -> int:
        """Smallest request bucket >= n. A prompt exactly at a boundary uses that bucket."""
        if n < 1:
            raise BucketError(f"a prompt needs at least one token, got {n}")
        for length in self.lengths:
            if length >= n:
                return length
        c = self.chunk_length
        if c and n <= self.context_length:
            return -(-n // c) * c
        raise PromptTooLongError(n, self.context_length if c else self.max_length)

    def batch_for(self, rows: int) -> int:
        """Smallest decode batch bucket holding `rows` rows."""
        return smallest_at_least(self.batch_sizes, rows)

    def prefill_batch_for(self, rows: int) -> int:
        """Smallest prefill batch bucket holding `rows` rows."""
        return smallest_at_least(self.prefill_batch_sizes, rows)

    def kv_for(self, positions: int) -> int:
        """Smallest KV-length bucket holding `positions` cache positions (the longest row's position + 1)."""
        for kv in self.kv_lengths:
            if kv >= positions >= 1:
                return kv
        raise BucketError(f"{positions} cache positions are outside 1..{self.context_length}")

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Validate one request against the table; returns its length bucket."""
        bucket = self.length_for(prompt_tokens)
        if prompt_tokens + max_new_tokens > self.context_length:
            raise PromptTooLongError(prompt_tokens + max_new_tokens, self.context_length, "prompt + max_tokens")
        return bucket

    # -- graphs ------------------------------------------------------------------------------------
    def graph_keys(self) -> Iterator[GraphKey]:
        """Every graph, in the fixed warm-up order: decode graphs first (smallest batch, then shortest KV
        first: they are the most used), then prefill graphs by length, then rows."""
        for b in self.batch_sizes:
            for kv in self.kv_lengths:
                yield GraphKey("decode", b, kv)
        for kv in self.chunk_kv_lengths:
            yield GraphKey("chunk", 1, kv)
        for rows in self.sample_batch_sizes:
            yield GraphKey("sample", rows, 0)
        for length in self.lengths:
            for p in self.prefill_batch_sizes:
                yield GraphKey("prefill", p, length)
        for tokens in self.mixed_tokens:
            yield GraphKey("mixed", self.max_batch, tokens)
        for tokens in self.verify_tokens:
            yield GraphKey("verify", self.verify_rows, tokens)

    @property
    def num_graphs(self) -> int:
        return (len(self.batch_sizes) * len(self.kv_lengths) + len(self.chunk_kv_lengths)
                + len(self.sample_batch_sizes) + len(self.lengths) * len(self.prefill_batch_sizes)
                + len(self.mixed_tokens) + len(self.verify_tokens))

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def default(
        cls,
        model_max_length: int,
        *,
        max_length: int | None = None,
        min_length: int = DEFAULT_MIN_LENGTH,
        batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
        prefill_batch_sizes: tuple[int, ...] = (1,),
        kv_lengths: tuple[int, ...] = (),
        chunk_length: int = 0,
    ) -> BucketTable:
        """Powers of two from `min_length` up to the smaller of the model's context and `max_length`; with
        `chunk_length` (0: off), up to the chunk length, and longer prompts are prefilled in chunks."""
        limit = model_max_length if max_length is None else min(model_max_length, max_length)
        chunked = 0 < chunk_length < limit
        top = chunk_length if chunked else limit
        return cls(
            lengths=powers_of_two(min(min_length, top), top),
            batch_sizes=batch_sizes,
            prefill_batch_sizes=prefill_batch_sizes,
            context_length=limit,
            kv_lengths=kv_lengths,
            chunked_prefill=chunked,
        )

    def to_dict(self) -> dict[str, object]:
        """The table as JSON values (buckets/table_file.py reads it back)."""
        return {f.name: list(v) if isinstance(v, tuple) else v for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> BucketTable:
        return table_file.from_dict(cls, data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BucketTable:
        return table_file.load(cls, path)
