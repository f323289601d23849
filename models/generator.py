"""Offline generation of one request through the bucketed runner (slot 0, batch bucket 1): the
`bucketserve generate` command and the correctness tests use it; the server uses the engine instead."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from models.runner import ModelRunner, PrefillRow
from models.sampling import Sampler, SamplingParams
from models.shape_table import ShapeTable


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: list[float] = field(default_factory=list)


def solo_pieces(table: ShapeTable, prompt_len: int, length_bucket: int) -> tuple[int, int]:
    """How a lone prompt is prefilled, as the scheduler runs it: (tokens of its first piece, by the prefill graph
    of its length bucket, 0 for none; tokens per later piece, in mixed steps where the table has them, else in
    chunks). A prompt longer than the largest length bucket goes in mixed steps of the solo budget from its start
    where that exceeds the mixed budget (buckets/scheduler.py)."""
    if table.mixed_tokens and prompt_len > table.max_length and table.solo_budget > table.mixed_budget:
        return 0, table.solo_budget
    first = min(length_bucket, table.max_length)
    return first, (table.mixed_budget if table.mixed_tokens else table.chunk_length or prompt_len)


def generate_one(
    runner: ModelRunner,
    prompt_ids: list[int],
    params: SamplingParams,
    length_bucket: int,
    eos_token_ids: frozenset[int] = frozenset(),
) -> GenerationResult:
    """Prefill into slot 0 padded to `length_bucket` (a longer prompt chunk by chunk, as the scheduler would
    run it), then decode in the smallest batch bucket."""
    sampler = Sampler(params, prompt_ids)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    batch = runner.table.batch_sizes[0]
    prefill_rows = runner.table.prefill_batch_sizes[0]
    t0 = time.perf_counter()
    table = runner.table
    # As the scheduler runs a lone prompt: a longer one than the largest length bucket in mixed steps of the solo
    # budget where that exceeds a chunk; else its first chunk by the prefill graph, the rest in mixed steps of the
    # mixed budget when the table has them, or in chunks.
    first, piece = solo_pieces(table, len(prompt_ids), length_bucket)
    if first:
        logits = runner.prefill([PrefillRow(0, prompt_ids[:first])], first, prefill_rows)
    for offset in range(first, len(prompt_ids), piece):
        part = prompt_ids[offset : offset + piece]
        if table.mixed_tokens:
            where = list(range(offset, offset + len(part)))
            logits = runner.mixed(table.mixed_for(len(part)), part, where, [0] * len(part), [len(part) - 1])
        else:
            logits = runner.chunk(0, offset, part, table.kv_for(offset + len(part)))
    token = sampler.sample(logits[0]).token_id
    result = GenerationResult([token], "length", time.perf_counter() - t0)
    tokens = torch.zeros(batch, dtype=torch.long)
    positions = torch.full((batch,), -1, dtype=torch.long)  # rows past the first: free slots
    pos = len(prompt_ids)
    while True:
        if token in stop_ids:
            result.finish_reason = "stop"
            break
        if len(result.token_ids) >= params.max_tokens or pos >= runner.table.context_length:
            break
        tokens[0], positions[0] = token, pos
        t0 = time.perf_counter()
        logits = runner.decode(batch, tokens, positions)
        token = sampler.sample(logits[0]).token_id
        result.decode_seconds.append(time.perf_counter() - t0)
        result.token_ids.append(token)
        pos += 1
    return result
