"""A fixed greedy workload over the runner, run once single-process and once as rank 0 of a TP mesh.

Prompts across every length bucket, batch mixes of 1, 2 and 3 live rows in decode buckets 1, 2 and 4,
decode crossing KV buckets, and a prompt past the largest length bucket prefilled in chunks. Returns the
greedy tokens of every sequence and each step's logits (so the two runs can be compared to a tolerance).
"""

from __future__ import annotations

import random

import torch

from buckets import BucketTable
from models.runner import ModelRunner, PrefillRow

TABLE = BucketTable(lengths=(8, 16), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=48,
                    kv_lengths=(16, 32, 48), chunked_prefill=True)


def _prompt(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(5, 400), k=n)


def run_workload(runner: ModelRunner) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per sequence ([4 sequences]) and every step's logits, in call order."""
    logits_log: list[torch.Tensor] = []

    def keep(x: torch.Tensor) -> torch.Tensor:
        logits_log.append(x.detach().clone())
        return x

    prompts = {1: _prompt(1, 5), 0: _prompt(2, 8), 2: _prompt(3, 12), 3: _prompt(4, 30)}
    out: dict[int, list[int]] = {}
    # Two rows of different lengths in one prefill batch (length bucket 8).
    first = keep(runner.prefill([PrefillRow(1, prompts[1]), PrefillRow(0, prompts[0])], 8, 2))
    out[1], out[0] = [int(first[0].argmax())], [int(first[1].argmax())]
    # One row alone in length bucket 16.
    out[2] = [int(keep(runner.prefill([PrefillRow(2, prompts[2])], 16, 1))[0].argmax())]
    # A 30-token prompt: its first 16 tokens, then one chunk of 14 (chunk length 16, KV bucket 32).
    keep(runner.prefill([PrefillRow(3, prompts[3][:16])], 16, 1))
    out[3] = [int(keep(runner.chunk(3, 16, prompts[3][16:], TABLE.kv_for(30)))[0].argmax())]
    # Decode: 4 live rows (batch 4), then rows 0 and 1 only (batch 2), then row 0 alone (batch 1).
    for live, batch, steps in (((0, 1, 2, 3), 4, 5), ((0, 1), 2, 4), ((0,), 1, 6)):
        for _ in range(steps):
            tokens = torch.zeros(batch, dtype=torch.long)
            positions = torch.zeros(batch, dtype=torch.long)
            for slot in live:
                tokens[slot] = out[slot][-1]
                positions[slot] = len(prompts[slot]) + len(out[slot]) - 1
            logits = keep(runner.decode(batch, tokens, positions))
            for slot in live:
                out[slot].append(int(logits[slot].argmax()))
    return [out[s] for s in sorted(out)], logits_log
