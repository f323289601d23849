"""Bucket planner: choose prompt-length buckets that minimise the expected prefill cost of a workload.

Cost model. A prompt of `n` tokens routed to length bucket `L` (the smallest bucket >= n) costs

    cost(L) = L + alpha * L**2

i.e. the padded tokens pushed through the linear layers plus an attention term that grows with the
square of the padded length. The cost depends on the bucket only, never on `n`: padding is paid in
full. `alpha` is the weight of the attention term; `default_alpha(limit) = 1 / limit` makes the two
terms equal for a bucket as long as the context.

Padding ratio = pad tokens / computed tokens = sum(L - n) / sum(L), the share of prefill token
compute that is padding (0 = none; bounded by 1). `pad_per_real` = sum(L - n) / sum(n) is also kept.

Optimality. Because cost(L) increases with L, a bucket that is not at an observed length can be
lowered to the largest observed length it serves without changing routing, so an optimal plan only
uses observed lengths, plus the forced top bucket (the largest observed length, or the context limit
when `cover_limit`). The exact dynamic programme over the m distinct lengths,

    f[k][j] = c_j * W_j + min_{i<j} (f[k-1][i] - c_j * W_i)      (W = prefix counts, c_j = cost(v_j)),

is a lower envelope of lines with slopes -W_i (decreasing in i) queried at c_j (increasing in j), so
a monotone convex-hull trick evaluates each layer in O(m): O(K * m) in total. Pure Python, no numpy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from buckets.table import BucketError

Lengths = Sequence[int] | Mapping[int, int]  # raw lengths, or a histogram length -> count


def default_alpha(limit: int) -> float:
    """Attention weight that makes `alpha * L**2 == L` for a bucket as long as the context."""
    if limit < 1:
        raise BucketError(f"limit must be positive to derive alpha, got {limit}")
    return 1.0 / limit


def bucket_cost(length: int, alpha: float) -> float:
    return length + alpha * length * length


def to_histogram(lengths: Lengths) -> dict[int, int]:
    """Validated length -> count histogram (counts > 0 only)."""
    hist = dict(lengths) if isinstance(lengths, Mapping) else dict(Counter(lengths))
    for n, c in hist.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BucketError(f"prompt lengths must be positive integers, got {n!r}")
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise BucketError(f"count for length {n} must be a non-negative integer, got {c!r}")
    return {n: c for n, c in sorted(hist.items()) if c > 0}


def split_over_limit(hist: Mapping[int, int], limit: int | None) -> tuple[dict[int, int], int]:
    """(lengths <= limit, number of prompts above it). Over-limit prompts cannot be served at all."""
    if limit is None:
        return dict(hist), 0
    kept = {n: c for n, c in hist.items() if n <= limit}
    return kept, sum(c for n, c in hist.items() if n > limit)


@dataclass(frozen=True)
class Evaluation:
    """How a bucket list serves a workload. Cost and token sums cover the served prompts only."""

    buckets: tuple[int, ...]
    prompts: int  # served (covered by some bucket)
    uncovered: int  # longer than the largest bucket
    real_tokens: int
    computed_tokens: int
    total_cost: float
    alpha: float

    @property
    def pad_tokens(self) -> int:
        return self.computed_tokens - self.real_tokens

    @property
    def padding_ratio(self) -> float:
        """Pad tokens / computed tokens."""
        return self.pad_tokens / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def pad_per_real(self) -> float:
        return self.pad_tokens / self.real_tokens if self.real_tokens else 0.0

    @property
    def mean_cost(self) -> float:
        """Expected cost of one served prompt."""
        return self.total_cost / self.prompts if self.prompts else 0.0


def evaluate(buckets: Sequence[int], lengths: Lengths, *, alpha: float) -> Evaluation:
    """Route every prompt to its smallest covering bucket and total the padding and cost."""
    bs = tuple(buckets)
    if not bs or list(bs) != sorted(set(bs)) or bs[0] < 1:
        raise BucketError(f"buckets {list(bs)} must be positive and strictly increasing")
    if alpha < 0 or not math.isfinite(alpha):
        raise BucketError(f"alpha must be a finite number >= 0, got {alpha}")
    prompts = uncovered = real = computed = 0
    cost = 0.0
    i = 0
    for n, c in to_histogram(lengths).items():  # sorted by length, so the bucket index only grows
        while i < len(bs) and bs[i] < n:
            i += 1
        if i == len(bs):
            uncovered += c
            continue
        prompts += c
        real += n * c
        computed += bs[i] * c
        cost += c * bucket_cost(bs[i], alpha)
    return Evaluation(bs, prompts, uncovered, real, computed, cost, alpha)


@dataclass(frozen=True)
class PlanResult:
    """The best plan with at most `max_buckets` buckets, and the best plan for every k up to it."""

    buckets: tuple[int, ...]
    evaluation: Evaluation
    over_limit: int  # prompts longer than the limit, excluded from the plan
    max_buckets: int
    limit: int | None
    by_k: tuple[Evaluation, ...]  # by_k[k-1]: the optimum with at most k buckets


def plan_buckets(
    lengths: Lengths,
    max_buckets: int,
    *,
    alpha: float,
    limit: int | None = None,
    cover_limit: bool = False,
    multiple_of: int = 1,
) -> PlanResult:
    """Exact minimum-cost buckets: at most `max_buckets` of them, each a multiple of `multiple_of`
    (or the limit), the largest covering the largest served length (the limit if `cover_limit`).
    Prompts longer than `limit` are counted in `over_limit` and excluded."""
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise BucketError(f"max_buckets must be a positive integer, got {max_buckets!r}")
    if alpha < 0 or not math.isfinite(alpha):
        raise BucketError(f"alpha must be a finite number >= 0, got {alpha}")
    if limit is not None and limit < 1:
        raise BucketError(f"limit must be positive, got {limit}")
    if cover_limit and limit is None:
        raise BucketError("cover_limit needs a limit")
    if multiple_of < 1:
        raise BucketError(f"multiple_of must be positive, got {multiple_of}")
    hist, over = split_over_limit(to_histogram(lengths), limit)
    if not hist:
        raise BucketError("no prompt lengths within the limit to plan for")
    # Candidate bucket positions: observed lengths rounded up to the alignment (never past the limit).
    cand: Counter[int] = Counter()
    for n, c in hist.items():
        v = -(-n // multiple_of) * multiple_of
        cand[v if limit is None else min(v, limit)] += c
    if cover_limit and limit is not None and limit not in cand:
        cand[limit] = 0  # forced top bucket that no prompt needs exactly; the DP may leave it empty
    values = sorted(cand)
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + cand[v])
    choices = _dp(values, prefix, min(max_buckets, len(values)), alpha)
    by_k: list[Evaluation] = []
    for k in range(1, max_buckets + 1):
        plan = choices[min(k, len(choices)) - 1]
        by_k.append(evaluate(plan, hist, alpha=alpha))
    best = by_k[0]
    for ev in by_k[1:]:
        if ev.total_cost < best.total_cost:  # strict: on a tie the plan with fewer graphs wins
            best = ev
    return PlanResult(best.buckets, best, over, max_buckets, limit, tuple(by_k))


def _dp(values: list[int], prefix: list[int], kmax: int, alpha: float) -> list[tuple[int, ...]]:
    """Optimal bucket lists with exactly k buckets (k = 1..kmax), all ending at values[-1].
    Position j (1-based) is values[j-1]; position 0 is the empty prefix."""
    m = len(values)
    inf = math.inf
    c = [0.0] + [bucket_cost(v, alpha) for v in values]
    prev = [0.0] + [inf] * m  # f[0]: nothing covered with no buckets
    parents: list[list[int]] = []
    for _k in range(1, kmax + 1):
        cur = [inf] * (m + 1)
        parent = [-1] * (m + 1)
        hull: list[int] = []  # indices i whose lines y = -W_i x + prev[i] form the lower envelope
        head = 0
        for j in range(1, m + 1):
            i = j - 1
            if prev[i] < inf:  # add line i (slopes strictly decrease because W strictly increases)
                while len(hull) - head >= 2 and _useless(hull[-2], hull[-1], i, prev, prefix):
                    hull.pop()
                hull.append(i)
                head = min(head, len(hull) - 1)
            if len(hull) == head:
                continue
            x = c[j]  # queries increase with j, so the best line only moves forward
            while head + 1 < len(hull) and _at(hull[head + 1], x, prev, prefix) <= _at(hull[head], x, prev, prefix):
                head += 1
            best = hull[head]
            cur[j] = _at(best, x, prev, prefix) + x * prefix[j]
            parent[j] = best
        parents.append(parent)
        prev = cur
    plans: list[tuple[int, ...]] = []
    for k in range(1, kmax + 1):
        out: list[int] = []
        j = m
        for level in range(k - 1, -1, -1):
            out.append(values[j - 1])
            j = parents[level][j]
        plans.append(tuple(reversed(out)))
    return plans


def _at(i: int, x: float, f: list[float], w: list[int]) -> float:
    return f[i] - x * w[i]


def _useless(a: int, b: int, d: int, f: list[float], w: list[int]) -> bool:
    """Line b (between a and d in slope order) never attains the minimum: the crossing of a and d
    comes no later than the crossing of a and b."""
    # crossing(a, b) at x = (f_b - f_a) / (w_b - w_a); slopes -w, with w_a < w_b < w_d.
    return (f[d] - f[a]) * (w[b] - w[a]) <= (f[b] - f[a]) * (w[d] - w[a])
