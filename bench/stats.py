"""Statistics over request results: percentiles, latency summaries, throughput, per-bucket breakdown.

Percentiles interpolate linearly between order statistics (numpy's default "linear" method), written out
here so the bench needs no numpy and the tests can check against hand-computed values.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Sequence

from bench.client import RequestResult

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between the two nearest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean and p50/p90/p99 (None when there are no values)."""
    out: dict[str, float | int | None] = {"count": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for q in QUANTILES:
        out[f"p{q}"] = percentile(values, q) if values else None
    return out


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive token-bearing chunks (the first token's latency is TTFT, not an ITL)."""
    return [b - a for a, b in zip(token_times, token_times[1:])]


def time_per_output_token(res: RequestResult) -> float | None:
    """(e2e - ttft) / (tokens - 1): the per-token decode time, robust to servers that batch chunks."""
    if res.ttft is None or res.e2e is None or res.output_tokens < 2:
        return None
    return (res.e2e - res.ttft) / (res.output_tokens - 1)


def group_by_bucket(results: Iterable[RequestResult]) -> dict[int, list[RequestResult]]:
    groups: dict[int, list[RequestResult]] = {}
    for res in results:
        groups.setdefault(res.bucket, []).append(res)
    return dict(sorted(groups.items()))


def failure_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    return dict(sorted(Counter(r.error or "unknown" for r in results if not r.ok).items()))


def latency_summaries(results: Sequence[RequestResult]) -> dict[str, dict[str, float | int | None]]:
    ok = [r for r in results if r.ok]
    itl = [gap for r in ok for gap in inter_token_latencies(r.token_times)]
    tpots = [t for t in (time_per_output_token(r) for r in ok) if t is not None]
    return {
        "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
        "itl": summarize(itl),
        "tpot": summarize(tpots),
        "e2e": summarize([r.e2e for r in ok if r.e2e is not None]),
    }


def level_stats(results: Sequence[RequestResult], wall_seconds: float, concurrency: int) -> dict[str, Any]:
    """Everything the report says about one concurrency level."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    stats: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": failure_counts(results),
        "wall_seconds": wall_seconds,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens_per_s": output_tokens / wall_seconds if wall_seconds > 0 else None,
        "requests_per_s": len(ok) / wall_seconds if wall_seconds > 0 else None,
    }
    stats.update(latency_summaries(results))
    stats["per_bucket"] = {
        str(bucket): {
            "requests": len(group),
            "completed": sum(r.ok for r in group),
            "failures": failure_counts(group),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in group) / len(group),
            **latency_summaries(group),
        }
        for bucket, group in group_by_bucket(results).items()
    }
    return stats
