"""How many tokens a mixed step carries: pure functions of the bucket table, for the scheduler
(buckets/scheduler.py)."""

from __future__ import annotations

from buckets.table import BucketTable


def solo_prompt(table: BucketTable, n: int) -> bool:
    """Whether a prompt of `n` tokens at a server where nothing decodes starts by mixed steps of the solo budget
    (larger than a chunk) rather than a prefill: a prompt longer than the largest length bucket (instead of a
    prefill of its first chunk), and a prompt that fits a length bucket where two mixed steps pad less than its
    prefill (140 tokens: 128 + 32 token buckets, not the 256 length bucket)."""
    if n > table.max_length:
        return table.solo_budget > table.mixed_budget
    if n > table.solo_budget:
        return False
    first = trimmed(table, n, 0)
    split = table.mixed_for(first) + (table.mixed_for(n - first) if first < n else 0)
    return split < table.length_for(n)


def trimmed(table: BucketTable, tokens: int, rows: int) -> int:
    """How many of `tokens` (the step's tokens: `rows` decoding rows, then prompt tokens) a mixed step
    carries: all of them, or only the next token bucket below when their own bucket would be mostly
    padding. The cut tokens go into the next step; padding costs as much as a real token (a step's matmuls
    run every row of its bucket), so the cut pays when that bucket plus the bucket of the cut tokens (with
    the decoding rows again: the next step's size where nothing else comes) sum to less. E.g. 8 rows + 152
    prompt tokens: 128 now and 32 + 8 in a 64 next, 192 tokens run instead of 256 (measured, one thread,
    bf16: a mixed step costs ~1.25 ms a bucket token from 64 to 512 tokens)."""
    if tokens <= table.mixed_tokens[0]:
        return tokens
    below = max(b for b in table.mixed_tokens if b < tokens)  # > rows: a prompt token stays in the step
    if below > rows and below + table.mixed_for(rows + tokens - below) < table.mixed_for(tokens):
        return below
    return tokens
