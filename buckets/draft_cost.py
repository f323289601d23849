"""Whether draft tokens pay for what they cost: the goodput rule of cost-aware speculative decoding (SmartSpec's
idea: draft only while the expected accepted tokens come cheaper than the step's own), fitted to the step times
the engine measures as it serves. Pure Python; the scheduler (buckets/scheduler.py) asks `threshold` before it plans
a step's drafts and feeds `observe`.

The model: a step that computes n tokens takes a + b*n seconds (a: reading the weights and the fixed work of a
step, b: the arithmetic of one more token), fitted by least squares over recent steps of decoding rows (decode
steps, and verify steps without prompt pieces: a prompt piece's attention would tilt the line). A draft that yields
a token with chance q adds q tokens and b seconds to a step of n tokens in a + b*n, so it raises the step's tokens a
second exactly when

    q > b*n / (a + b*n)

the step's threshold. Each row knows its own q (buckets/speculation.py: its recent acceptance, draft by draft), so a
row that repeats itself drafts where the others do not. Where a step is memory-bound (bf16 weights on a CPU with
AVX512-BF16, or a one-stream step) b is small beside a and most drafts pay; where each token costs its full
arithmetic (float32 on a core with 256-bit FMAs: ~40 ms to read the weights, ~3 ms a token) a 16-row step's
threshold is ~0.55: only rows whose drafts are mostly accepted carry them. Session 53's drafts for every row lost 12%
to none at 16 clients there; one acceptance for all rows (session 54) left most 8- and 16-row steps without drafts
(docs/performance.md). Until the line is known (fewer than two distinct step sizes seen) the threshold is 0: drafts
run as the rows' limits allow, and that is what measures them.
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


@dataclass
class DraftCost:
    decay: float = DECAY
    # decayed sums over observed steps: weight, n, n², seconds, n * seconds
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _t: float = 0.0
    _nt: float = 0.0
    steps: int = field(default=0)  # steps observed

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

    def threshold(self, tokens: int) -> float:
        """The least chance of yielding a token at which a draft pays beside a step's `tokens` other tokens (the rule
        above): b n / (a + b n). 0 (every draft pays) while the line is not known, and where it gives a token no
        cost; 1 (none does) where the line gives the step no time."""
        fit = self.line()
        if fit is None:
            return 0.0
        a, b = fit
        if b <= 0.0:
            return 0.0
        total = a + b * tokens
        return min(1.0, b * tokens / total) if total > 0.0 else 1.0
