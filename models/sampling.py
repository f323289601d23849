"""Token sampling on the logits a graph returns: greedy, temperature, top-k, top-p, min-p, penalties,
seeded per request. Runs eagerly on the host after the compiled graph, so the graphs stay free of
per-request options (one graph per shape, whatever the sampling settings)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. `temperature == 0` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _finite(self, "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        if self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SamplingError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise SamplingError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise SamplingError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise SamplingError("repetition_penalty", f"must be in [0.01, 100], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingError("logprobs", f"must be in [0, 20], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        # A vanishing temperature is greedy in the limit; dividing by it would overflow to inf/NaN.
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _finite(params: SamplingParams, *names: str) -> None:
    for name in names:
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SamplingError(name, f"must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


class Sampler:
    """A request's sampling state. `seed` feeds the sampling graph's noise (with the token's position); the
    host path below (penalties, and rows the graph cannot sample exactly) samples one row at a time with a
    generator of its own. Either way the request's seed alone decides its text, whatever shares the batch."""

    SEED_RANGE = 2**31 - 1  # the sampling graph hashes seeds modulo this prime

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
