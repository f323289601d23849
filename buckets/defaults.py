"""Default bucket sizes: what a `BucketTable` holds when the operator names none. The measurements behind each
figure are in docs/performance.md. Pure Python, like the table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from buckets.sizes import powers_of_two

if TYPE_CHECKING:
    from buckets.table import BucketTable

# Shortest default length bucket. On the CPU a short prompt's prefill is cheaper in a smaller bucket (bf16, one
# thread, SmolLM2-135M: 30 tokens take 32.1 ms in bucket 32 against 40.0 in bucket 64; docs/performance.md) for
# one more prefill graph and one more mixed-step graph (about 10 s of a cold warm-up each); where a graph
# compiles for minutes (Neuron), the buckets start at 64.
DEFAULT_MIN_LENGTH = 64
CPU_MIN_LENGTH = 32

# Default decode batch buckets: a step reads the weights once for every row, so 16 rows cost 1.6x one row here
# (bfloat16, docs/performance.md); 2 is left out (a 4-row step costs about what a 2-row one does).
DEFAULT_BATCH_SIZES = (1, 4, 8, 16)
# Shortest default KV bucket: below it a decode step is dominated by reading the weights, not the cache.
MIN_KV_LENGTH = 256


def default_kv_lengths(context_length: int) -> tuple[int, ...]:
    """KV-length buckets when none are given: powers of two from MIN_KV_LENGTH, closed by the context length.
    The longest row of a batch picks the bucket, so with 16 rows the middle buckets carry most steps
    (measured in docs/performance.md)."""
    return powers_of_two(min(MIN_KV_LENGTH, context_length), context_length)


# Most tokens a mixed step carries when prompts are not chunked (else the chunk length): measured on the CPU,
# 512 made no more output tokens/s than 256 and doubled the inter-token latency p99 (docs/performance.md).
MIXED_TOKEN_BUDGET = 256
# Most tokens a mixed step carries while rows decode, on the server's default table (`max_step_tokens`): 128
# against 256 (the chunk) made output tokens/s level within noise at 4-16 clients (six served alternations, pairs
# -7% to +9%, means +0.5-0.7%, the last two pairs -2%) and halved the inter-token latency p99 (one thread, bf16:
# 8 clients 337-376 -> 185-201 ms, 16 clients 363-519 -> 201-233 ms; docs/performance.md, "Steps of 128 tokens
# while rows decode").
MIXED_STEP_TOKENS = 128
# The smallest token bucket of a verify step (speculative decoding): a padding token costs about what a real one does
# (scripts/bench_mixed.py), so one row and its drafts (2-4 tokens) run in a bucket of 8, not the smallest mixed one
# (32 on the CPU, the smallest length bucket).
MIN_VERIFY_TOKENS = 8
# Most prompt tokens a mixed step carries when nothing decodes (the solo budget of the default table): a lone
# 1024-token prompt in one step instead of four (docs/performance.md, "Solo steps").
SOLO_TOKEN_BUDGET = 1024


def default_mixed_tokens(table: BucketTable) -> tuple[int, ...]:
    """Token buckets for mixed steps: the length buckets up to the chunk length (up to MIXED_TOKEN_BUDGET when
    prompts are not chunked: a mixed step cuts any prompt), so a step with decoding rows costs at most about one
    chunk; then doublings of that up to SOLO_TOKEN_BUDGET within the context, for steps without decoding rows.
    () when they cannot hold every decoding row plus a prompt token."""
    cap = table.chunk_length or MIXED_TOKEN_BUDGET
    tokens = tuple(n for n in table.lengths if n <= cap)
    if not tokens or tokens[-1] <= table.max_batch:
        return ()
    solo = tokens[-1] * 2
    while solo <= min(SOLO_TOKEN_BUDGET, table.context_length):
        tokens += (solo,)
        solo *= 2
    return tokens


def default_step_tokens(table: BucketTable) -> int:
    """`max_step_tokens` for a table with mixed steps: MIXED_STEP_TOKENS where a token bucket of at most that many
    holds every decoding row plus a prompt token (else 0: up to the chunk)."""
    fits = [n for n in table.mixed_tokens if table.max_batch < n <= MIXED_STEP_TOKENS]
    return MIXED_STEP_TOKENS if fits and table.mixed_budget > MIXED_STEP_TOKENS else 0
