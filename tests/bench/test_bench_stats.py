from __future__ import annotations

import pytest

from bench.client import RequestResult
from bench.stats import (
    group_by_bucket,
    inter_token_latencies,
    level_stats,
    percentile,
    summarize,
    time_per_output_token,
)


def test_percentile_matches_hand_computed_linear_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7 -> 3 + 0.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    # 11 values 0..100 step 10: p90 is exactly the 10th order statistic
    assert percentile([float(10 * i) for i in range(11)], 90) == pytest.approx(90.0)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_empty_and_values() -> None:
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    s = summarize([1.0, 2.0, 3.0])
    assert s["count"] == 3 and s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)


def _ok(index: int, bucket: int, times: list[float], e2e: float, tokens: int | None = None) -> RequestResult:
    r = RequestResult(index, prompt_tokens=bucket // 2, bucket=bucket, start=0.0, ok=True, status=200)
    r.token_times = times
    r.ttft = times[0]
    r.e2e = e2e
    r.output_tokens = len(times) if tokens is None else tokens
    return r


def test_itl_and_tpot_from_chunk_timestamps() -> None:
    r = _ok(0, 64, [0.10, 0.15, 0.25, 0.30], e2e=0.31)
    assert inter_token_latencies(r.token_times) == pytest.approx([0.05, 0.10, 0.05])
    assert r.ttft == pytest.approx(0.10)
    assert time_per_output_token(r) == pytest.approx((0.31 - 0.10) / 3)
    # a server that sends several tokens per chunk: TPOT uses the usage count, not the chunk count
    batched = _ok(1, 64, [0.1, 0.5], e2e=0.5, tokens=9)
    assert time_per_output_token(batched) == pytest.approx(0.4 / 8)
    assert time_per_output_token(_ok(2, 64, [0.2], e2e=0.2)) is None


def test_level_stats_counts_failures_throughput_and_buckets() -> None:
    results = [
        _ok(0, 64, [0.1, 0.2, 0.3], e2e=0.3),
        _ok(1, 64, [0.2, 0.4, 0.6], e2e=0.6),
        _ok(2, 128, [0.4, 0.5, 0.6], e2e=0.7),
        RequestResult(3, 10, 16, 0.0, error="http_503", status=503),
        RequestResult(4, 10, 16, 0.0, error="timeout"),
        RequestResult(5, 10, 128, 0.0, error="http_503", status=503),
    ]
    s = level_stats(results, wall_seconds=2.0, concurrency=4)
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["failures"] == {"http_503": 2, "timeout": 1}
    assert s["output_tokens"] == 9
    assert s["output_tokens_per_s"] == pytest.approx(4.5)
    assert s["requests_per_s"] == pytest.approx(1.5)
    assert s["ttft"]["count"] == 3 and s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["itl"]["count"] == 6  # two gaps per successful request
    assert s["e2e"]["p50"] == pytest.approx(0.6)
    assert list(s["per_bucket"]) == ["16", "64", "128"]
    assert s["per_bucket"]["64"]["requests"] == 2 and s["per_bucket"]["64"]["completed"] == 2
    assert s["per_bucket"]["64"]["ttft"]["p50"] == pytest.approx(0.15)
    assert s["per_bucket"]["128"]["failures"] == {"http_503": 1}
    assert s["per_bucket"]["16"]["ttft"]["count"] == 0
    assert sum(b["requests"] for b in s["per_bucket"].values()) == s["requests"]


def test_group_by_bucket_is_sorted_and_complete() -> None:
    rs = [_ok(i, b, [0.1], 0.1) for i, b in enumerate([256, 64, 256, 128])]
    groups = group_by_bucket(rs)
    assert list(groups) == [64, 128, 256]
    assert [r.index for r in groups[256]] == [0, 2]
