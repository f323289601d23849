"""Token sampling on the logits a graph returns: greedy, temperature, top-k, top-p, min-p, penalties,
seeded per request. Runs eagerly on the host after the compiled graph, so the graphs stay free of
per-request options (one graph per shape, whatever the sampling settings)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The record lives in the torch-free models.params; re-exported for the model-side callers.
from models.params import SamplingError, SamplingParams

__all__ = ["SampledToken", "Sampler", "SamplingError", "SamplingParams"]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


class Sampler:
    """A request's sampling state. `seed` feeds the sampling graph's noise (with the token's position); the
    host path below (penalties, and rows the graph cannot sample exactly) samples one row at a time with a
    generator of its own. Either way the request's seed alone decides its text, whatever shares the batch."""

    SEED_RANGE = 2**31 - 1  # the sampling graph hashes seeds below 2**31 (models/sample_graph.py hash_uniform)

    def __init__(self, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.params = params
        self._generator: torch.Generator | None = None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed % self.SEED_RANGE
        if not params.is_greedy:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(seed)
        self._prompt_ids = prompt_ids
        self._counts: dict[int, int] = {}

    def sample(self, logits: torch.Tensor) -> SampledToken:
        """logits: [V] float (any dtype/device); returns the chosen token and its logprobs."""
        p = self.params
        row = logits.float().cpu()
        if p.has_penalties:
            row = self._apply_penalties(row)
        if p.is_greedy:
            token = int(torch.argmax(row).item())
        else:
            token = self._draw(row)
        self._counts[token] = self._counts.get(token, 0) + 1
        if p.logprobs is None:
            return SampledToken(token, None, ())
        logp = torch.log_softmax(row, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs > 0:
            values, ids = torch.topk(logp, p.logprobs)
            top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
        return SampledToken(token, float(logp[token].item()), top)

    def _apply_penalties(self, row: torch.Tensor) -> torch.Tensor:
        p = self.params
        row = row.clone()
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(self._prompt_ids) | set(self._counts)), dtype=torch.long)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=row.dtype)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return row

    def _draw(self, row: torch.Tensor) -> int:
        p = self.params
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
            drop = cumulative - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return int(torch.argmax(row).item())  # degenerate distribution (overflowing logits): greedy
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
