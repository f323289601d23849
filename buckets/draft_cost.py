"""Whether draft tokens pay for what they cost: the goodput rule of cost-aware speculative decoding (SmartSpec's
idea: draft only while the expected accepted tokens come cheaper than the step's own), fitted to the step times
the engine measures as it serves. Pure Python; the scheduler (buckets/scheduler.py) asks `pays` before it plans a
step's drafts and feeds `observe` and `verified`.

The model: a step that computes n tokens takes a + b*n seconds (a: reading the weights and the fixed work of a
step, b: the arithmetic of one more token), fitted by least squares over recent steps of decoding rows (decode
steps, and verify steps without prompt pieces: a prompt piece's attention would tilt the line). A draft is
accepted with probability p (the recent accepted / drafted). D drafts beside n tokens yield n + p*D tokens in
a + b*(n + D) seconds against n in a + b*n, so they raise the step's tokens a second exactly when

    p * (a + b*n) > b * n

whatever D is. Where a step is memory-bound (bf16 weights on a CPU with AVX512-BF16, or a one-stream step) b is
small beside a and drafts pay; where each token costs its full arithmetic (float32 on a core with 256-bit FMAs:
~40 ms to read the weights, ~3.5 ms a token) they pay only at a few rows: drafts off at 16 clients there served
12% more tokens a second (docs/performance.md, session 53). Until the line is known (fewer than two distinct step
sizes seen, or no verify step yet), drafts run as before: that is what measures them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from buckets.steps import DecodeStep, MixedStep, Step

# Each observation's weight falls by this factor at every later one: ~50 steps of memory, so the fit follows the
# machine (another process, thermal drift) within seconds but one slow step moves it little.
DECAY = 0.98
# The fit is trusted once the steps it weighs spread this far in size (the weighted variance of n, tokens²):
# steps of one size alone give no slope.
MIN_SIZE_VARIANCE = 1.0
# Acceptance before any verify step: the rule does not run until one has (`pays` is True meanwhile).
PRIOR_ACCEPTANCE = 0.5


@dataclass
class DraftCost:
    decay: float = DECAY
    # decayed sums over observed steps: weight, n, n², seconds, n * seconds
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0
    # decayed drafted and accepted tokens of verify steps
    _drafted: float = 0.0
    _accepted: float = 0.0
    steps: int = field(default=0)  # steps observed
    verified_rows: int = field(default=0)  # verify results taken

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")

    def observe(self, step: Step, seconds: float) -> None:
        """A step ran in `seconds` (graph and sampling). Counted: decode steps (their live rows) and mixed steps
        of decoding rows alone (rows plus drafts); a step that carried prompt tokens is left out."""
        if isinstance(step, DecodeStep):
            n = len(step.seqs)
        elif isinstance(step, MixedStep) and not step.pieces:
            n = len(step.decode) + sum(map(len, step.drafts))
        else:
            return
        if n <= 0 or not seconds > 0.0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + n
        self._nn = self._nn * d + n * n
        self._t = self._t * d + seconds
        self._nt = self._nt * d + n * seconds
        self.steps += 1

    def verified(self, drafted: int, accepted: int) -> None:
        """One row of a verify step carried `drafted` drafts, of which `accepted` were confirmed."""
        if drafted <= 0:
            return
        self._drafted = self._drafted * self.decay + drafted
        self._accepted = self._accepted * self.decay + min(max(accepted, 0), drafted)
        self.verified_rows += 1

    @property
    def acceptance(self) -> float:
        return self._accepted / self._drafted if self._drafted > 0 else PRIOR_ACCEPTANCE

    def line(self) -> tuple[float, float] | None:
        """(a, b): seconds a step of n tokens takes, a + b*n; None until the sizes seen spread enough."""
        if self._w <= 0.0:
            return None
        mean_n = self._n / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < MIN_SIZE_VARIANCE:
            return None
        b = (self._nt / self._w - mean_n * self._t / self._w) / var_n
        a = self._t / self._w - b * mean_n
        return a, b

    def pays(self, tokens: int) -> bool:
        """Whether drafts beside a step's `tokens` other tokens raise its tokens a second (the rule above).
        True while the line or the acceptance is not yet measured, and where the line gives a token no cost."""
        fit = self.line()
        if fit is None or self._drafted <= 0:
            return True
        a, b = fit
        if b <= 0.0:
            return True
        p = self.acceptance
        return p * max(a + b * tokens, 0.0) > b * tokens
