from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buckets import BucketError
from buckets.planner import default_alpha, evaluate, plan_buckets, to_histogram

ALPHAS = st.sampled_from([0.0, 1 / 256, 1 / 64, 0.02, 0.5])
HISTS = st.dictionaries(st.integers(1, 80), st.integers(1, 20), min_size=1, max_size=8)


def brute_cost(buckets: tuple[int, ...], hist: dict[int, int], alpha: float) -> float:
    """Independent reference: route each length to its smallest covering bucket."""
    total = 0.0
    for n, c in hist.items():
        b = min(x for x in buckets if x >= n)
        total += c * (b + alpha * b * b)
    return total


def brute_best(hist: dict[int, int], k: int, alpha: float, top: int, candidates: set[int]) -> float:
    below = sorted(x for x in candidates if x < top)
    best = math.inf
    for r in range(0, k):
        for combo in itertools.combinations(below, r):
            best = min(best, brute_cost(combo + (top,), hist, alpha))
    return best


@settings(max_examples=150, deadline=None)
@given(hist=HISTS, k=st.integers(1, 4), alpha=ALPHAS, limit=st.one_of(st.none(), st.integers(20, 90)),
       cover=st.booleans())
def test_plan_is_optimal_against_brute_force(hist: dict[int, int], k: int, alpha: float, limit: int | None,
                                             cover: bool) -> None:
    cover = cover and limit is not None
    served = {n: c for n, c in hist.items() if limit is None or n <= limit}
    if not served:
        with pytest.raises(BucketError):
            plan_buckets(hist, k, alpha=alpha, limit=limit, cover_limit=cover)
        return
    plan = plan_buckets(hist, k, alpha=alpha, limit=limit, cover_limit=cover)
    top = limit if cover and limit is not None else max(served)
    candidates = set(served) | {top}
    for kk, ev in enumerate(plan.by_k, 1):
        expected = brute_best(served, kk, alpha, top, candidates)
        assert math.isclose(ev.total_cost, expected, rel_tol=1e-9, abs_tol=1e-9), (kk, ev.buckets)
        assert math.isclose(brute_cost(ev.buckets, served, alpha), ev.total_cost, rel_tol=1e-9)
    assert math.isclose(plan.evaluation.total_cost, brute_best(served, k, alpha, top, candidates), rel_tol=1e-9)
    assert plan.over_limit == sum(c for n, c in hist.items() if limit is not None and n > limit)


@settings(max_examples=150, deadline=None)
@given(hist=HISTS, k=st.integers(1, 6), alpha=ALPHAS, limit=st.one_of(st.none(), st.integers(20, 90)),
       cover=st.booleans(), multiple=st.sampled_from([1, 1, 8, 16]))
def test_plan_shape_and_top_bucket(hist: dict[int, int], k: int, alpha: float, limit: int | None, cover: bool,
                                   multiple: int) -> None:
    cover = cover and limit is not None
    served = {n: c for n, c in hist.items() if limit is None or n <= limit}
    if not served:
        return
    plan = plan_buckets(hist, k, alpha=alpha, limit=limit, cover_limit=cover, multiple_of=multiple)
    b = plan.buckets
    assert 1 <= len(b) <= k
    assert list(b) == sorted(set(b))
    if cover:
        assert b[-1] == limit
    else:
        assert b[-1] >= max(served)
        assert b[-1] == min(-(-max(served) // multiple) * multiple, limit if limit is not None else 10**9)
    assert all(x % multiple == 0 or x == limit for x in b)
    assert plan.evaluation.uncovered == 0
    assert plan.evaluation.prompts == sum(served.values())


@settings(max_examples=100, deadline=None)
@given(hist=HISTS, k=st.integers(1, 7), alpha=ALPHAS, cover=st.booleans())
def test_more_buckets_never_cost_more(hist: dict[int, int], k: int, alpha: float, cover: bool) -> None:
    limit = 100 if cover else None
    small = plan_buckets(hist, k, alpha=alpha, limit=limit, cover_limit=cover)
    large = plan_buckets(hist, k + 1, alpha=alpha, limit=limit, cover_limit=cover)
    assert large.evaluation.total_cost <= small.evaluation.total_cost * (1 + 1e-12)
    costs = [e.total_cost for e in large.by_k]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(costs, costs[1:]))
    assert math.isclose(large.by_k[k - 1].total_cost, small.evaluation.total_cost, rel_tol=1e-12)


def test_evaluate_by_hand() -> None:
    ev = evaluate((4, 8), [1, 4, 5, 8, 9], alpha=0.5)
    # 1,4 -> 4 ; 5,8 -> 8 ; 9 uncovered
    assert (ev.prompts, ev.uncovered) == (4, 1)
    assert ev.real_tokens == 18 and ev.computed_tokens == 24 and ev.pad_tokens == 6
    assert ev.padding_ratio == pytest.approx(6 / 24)
    assert ev.pad_per_real == pytest.approx(6 / 18)
    assert ev.total_cost == pytest.approx(2 * (4 + 8) + 2 * (8 + 32))
    assert ev.mean_cost == pytest.approx(ev.total_cost / 4)


def test_exact_fit_has_no_padding_and_zero_alpha_minimises_padding() -> None:
    plan = plan_buckets([10, 20, 20, 30], 3, alpha=0.0)
    assert plan.buckets == (10, 20, 30)
    assert plan.evaluation.padding_ratio == 0.0
    # one bucket must cover everything
    assert plan_buckets([10, 20, 30], 1, alpha=0.0).buckets == (30,)


def test_over_limit_lengths_are_excluded_and_counted() -> None:
    plan = plan_buckets({100: 5, 3000: 2, 2048: 1}, 2, alpha=default_alpha(2048), limit=2048)
    assert plan.over_limit == 2
    assert plan.buckets == (100, 2048)
    assert plan.evaluation.prompts == 6


def test_cover_limit_adds_the_limit_as_top_bucket() -> None:
    plan = plan_buckets([10, 20], 2, alpha=0.0, limit=64, cover_limit=True)
    assert plan.buckets == (20, 64)  # the limit bucket stays empty; 20 serves both
    with pytest.raises(BucketError, match="cover_limit"):
        plan_buckets([10], 2, alpha=0.0, cover_limit=True)


def test_fewer_distinct_lengths_than_buckets() -> None:
    plan = plan_buckets([7, 7, 9], 5, alpha=0.1)
    assert plan.buckets == (7, 9)
    assert len(plan.by_k) == 5 and plan.by_k[-1].buckets == (7, 9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_buckets": 0}, "max_buckets"),
        ({"alpha": -1.0}, "alpha"),
        ({"alpha": math.nan}, "alpha"),
        ({"limit": 0}, "limit"),
        ({"multiple_of": 0}, "multiple_of"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"max_buckets": 2, "alpha": 0.0, **kwargs}
    with pytest.raises(BucketError, match=match):
        plan_buckets([5, 6], **args)  # type: ignore[arg-type]


def test_bad_lengths_rejected() -> None:
    with pytest.raises(BucketError, match="positive"):
        to_histogram([3, 0])
    with pytest.raises(BucketError, match="no prompt lengths"):
        plan_buckets([5000], 2, alpha=0.0, limit=2048)
    with pytest.raises(BucketError, match="increasing"):
        evaluate((8, 4), [1], alpha=0.0)


def test_thousands_of_distinct_lengths_is_fast() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 8192) for _ in range(30_000)]
    start = time.perf_counter()
    plan = plan_buckets(lengths, 16, alpha=default_alpha(8192), limit=8192)
    elapsed = time.perf_counter() - start
    assert len(set(lengths)) > 5000
    assert len(plan.buckets) == 16
    assert elapsed < 5.0
