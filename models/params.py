"""The per-request generation settings as a pure record: no torch, so the HTTP layer can build and
validate them without loading the model stack (models/sampling.py holds the sampler that reads them).

The numeric bounds below are the only definition of each limit; the request models derive theirs from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-5
LOGPROBS_MAX = 20  # the sampling graph returns the top 20; keeps the top-k gather small
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties (OpenAI's range)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# The sampling graph holds each row's top_k in an int64 tensor, filled for the whole step at once: a larger value
# would fail every row of the step, not only its own. Any top_k past the vocabulary already means "off".
TOP_K_MAX = 2**63 - 1


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


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
        if not 0 <= self.top_k <= TOP_K_MAX:
            raise SamplingError("top_k", f"must be in [0, {TOP_K_MAX}] (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"must be in [0, 1], got {self.min_p}")
        low, high = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= getattr(self, name) <= high:
                raise SamplingError(name, f"must be in [{low:g}, {high:g}], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise SamplingError("repetition_penalty", f"must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= LOGPROBS_MAX:
            raise SamplingError("logprobs", f"must be in [0, {LOGPROBS_MAX}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        # A vanishing temperature is greedy in the limit; dividing by it would overflow to inf/NaN.
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def takes_drafts(self) -> bool:
        """Whether a row of these parameters may carry speculative drafts: its tokens are each row's maximum
        (greedy, no penalties), so a draft is accepted exactly where greedy decoding would produce it; and no
        logprobs (a verify step's drafts leave only their ids)."""
        return self.is_greedy and not self.has_penalties and self.logprobs is None


def _finite(params: SamplingParams, *names: str) -> None:
    for name in names:
        value = getattr(params, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SamplingError(name, f"must be a finite number, got {value!r}")
