"""Whether draft tokens pay for what they cost: the goodput rule of cost-aware speculative decoding (SmartSpec's
idea: draft only while the expected accepted tokens come cheaper than the step's own), fitted to the step times
the engine measures as it serves. Pure Python; the scheduler (buckets/scheduler.py) asks `threshold` before it plans
a step's drafts and feeds `observe`.

The model: a step of r decoding rows carrying d drafts takes a + b*r + c*d seconds (a: reading the weights and the
fixed work of a step; b: the arithmetic of one more row, and reading its K/V; c: one more draft, whose row's K/V its
run reads already), fitted by least squares over recent steps of decoding rows (decode steps, and verify steps without
prompt pieces: a prompt piece's attention would tilt the fit). Until the steps seen vary their drafts apart from their
rows, a draft is priced as a row (c = b, one line in r + d). A draft that yields a token with chance q adds q tokens
and c seconds to a step of n tokens in a + b*n, so it raises the step's tokens a second exactly when

    q > c*n / (a + b*n)

the step's threshold. Each row knows its own q (buckets/speculation.py: its recent acceptance, draft by draft), so a
row that repeats itself drafts where one that does not carries none. Where a step is memory-bound (bf16 weights on a
CPU with AVX512-BF16, or a one-stream step) b and c are small beside a and most drafts pay; where each token costs its
full arithmetic (float32 on a core with 256-bit FMAs, served: a ~30 ms, b ~5 ms with the K/V of a row at a few
hundred positions, c ~3 ms) a 16-row step's threshold is ~0.4. Session 53's drafts for every row lost 12% to none at
16 clients there; one acceptance for all rows and drafts priced as rows (session 54) left most 8- and 16-row steps
without drafts (docs/performance.md). Until the line is known (fewer than two distinct step sizes seen) the threshold
is 0: drafts run as the rows' limits allow, and that is what measures them.
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
# Drafts are priced apart from rows once their counts vary this far apart from the rows' (the weighted variance of d
# left once r explains what it can, drafts²); before that a draft costs what a row does.
MIN_DRAFT_VARIANCE = 1.0


@dataclass
class DraftCost:
    decay: float = DECAY
    # decayed sums over observed steps of r rows and d drafts taking t seconds: 1, r, d, r², r d, d², t, r t, d t
    _sums: list[float] = field(default_factory=lambda: [0.0] * 9)
    steps: int = field(default=0)  # steps observed

    def __post_init__(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")

    def observe(self, step: Step, seconds: float) -> None:
        """A step ran in `seconds` (graph and sampling). Counted: decode steps (their live rows) and mixed steps
        of decoding rows alone (rows plus drafts); a step that carried prompt tokens is left out."""
        if isinstance(step, DecodeStep):
            r, d = len(step.seqs), 0
        elif isinstance(step, MixedStep) and not step.pieces:
            r, d = len(step.decode), sum(map(len, step.drafts))
        else:
            return
        if r <= 0 or not seconds > 0.0:
            return
        t = seconds
        self._sums = [x * self.decay + y for x, y in zip(self._sums, (1.0, r, d, r * r, r * d, d * d, t, r * t, d * t))]
        self.steps += 1

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c): seconds a step of r rows and d drafts takes, a + b*r + c*d (c = b until the drafts seen vary
        apart from the rows); None until the sizes seen spread enough."""
        w, r, d, rr, rd, dd, t, rt, dt = self._sums
        if w <= 0.0:
            return None
        mr, md, mt = r / w, d / w, t / w
        vr, vd, crd = rr / w - mr * mr, dd / w - md * md, rd / w - mr * md
        crt, cdt = rt / w - mr * mt, dt / w - md * mt
        vn = vr + 2 * crd + vd  # the variance of n = r + d
        if vn < MIN_SIZE_VARIANCE:
            return None
        if vr > 0.0 and vd - crd * crd / vr >= MIN_DRAFT_VARIANCE:  # d varies apart from r: two slopes
            det = vr * vd - crd * crd
            b, c = (crt * vd - cdt * crd) / det, (cdt * vr - crt * crd) / det
        else:
            b = c = (crt + cdt) / vn
        return mt - b * mr - c * md, b, c

    def threshold(self, tokens: int) -> float:
        """The least chance of yielding a token at which a draft pays beside a step's `tokens` other tokens (the rule
        above): c n / (a + b n). 0 (every draft pays) while the fit is not known, and where it gives a draft no
        cost; 1 (none does) where it gives the step no time."""
        fit = self.fit()
        if fit is None:
            return 0.0
        a, b, c = fit
        if c <= 0.0:
            return 0.0
        total = a + b * tokens
        return min(1.0, c * tokens / total) if total > 0.0 else 1.0
