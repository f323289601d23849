"""What the Prometheus metrics look like: histogram edges (one frozen, validated `MetricsConfig`),
the bounded label vocabularies, the prompt-length edges and the labels of the info metric.

The latency defaults are vLLM's (vllm/v1/metrics/loggers.py: time to first token, time per output
token, end-to-end request latency), with 2.0 s added where vLLM lacks it, so that a "< 2 s" objective
is read from a bucket boundary instead of interpolated between 1.0 and 2.5.
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass, fields

from buckets import BucketTable

INFO_REQUIRED = ("model", "dtype", "device", "compile_backend")
INFO_FROM_TABLE = ("lengths", "batch_sizes", "prefill_batch_sizes", "kv_lengths", "context_length")
# Bounded label vocabularies; a value outside them is a programming error (ValueError).
COMPILE_PHASES = ("warmup", "serving")
RECOMPILE_REASONS = ("unwarmed_shape", "guard_failure", "other_rank")  # other_rank: a tensor-parallel follower
ARTIFACT_REJECT_REASONS = ("corrupt", "stale")
REJECT_REASONS = ("queue_full", "not_ready", "draining")
ABORT_REASONS = ("client", "timeout", "drain", "error", "stop_string")
FINISH_REASONS = ("stop", "length", "abort", "error")  # TokenEvent.finish_reason

# vLLM's TTFT edges plus 2.0.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's time-per-output-token edges plus 2.0.
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# vLLM's end-to-end request latency edges (2.0 is already there).
REQUEST_DURATION_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Graph compilation: a few hundred ms with the eager backend, up to an hour for inductor or Neuron.
COMPILE_BUCKETS: tuple[float, ...] = (
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
)  # fmt: skip
# Active rows / batch bucket: eighths are exact binary fractions, so the power-of-two batch buckets
# land exactly on an edge (3 of 8 rows -> le="0.375").
OCCUPANCY_BUCKETS: tuple[float, ...] = tuple(i / 8 for i in range(1, 9))


class MetricsConfigError(ValueError):
    """A metrics configuration field has a bad value; the message names it."""


@dataclass(frozen=True)
class MetricsConfig:
    """Histogram edges (upper bounds, seconds or ratios; +Inf is implicit) and label limits.

    Queue wait, prefill and decode-step times default to the TTFT edges rather than vLLM's
    request-latency ones: they are parts of TTFT and inter-token latency, usually milliseconds, and
    vLLM's request edges start at 0.3 s, which would put every observation in the first bucket."""

    ttft_buckets: tuple[float, ...] = TTFT_BUCKETS
    inter_token_buckets: tuple[float, ...] = INTER_TOKEN_BUCKETS
    request_duration_buckets: tuple[float, ...] = REQUEST_DURATION_BUCKETS
    queue_wait_buckets: tuple[float, ...] = TTFT_BUCKETS
    prefill_buckets: tuple[float, ...] = TTFT_BUCKETS
    decode_step_buckets: tuple[float, ...] = TTFT_BUCKETS
    compile_buckets: tuple[float, ...] = COMPILE_BUCKETS
    occupancy_buckets: tuple[float, ...] = OCCUPANCY_BUCKETS
    # Distinct `endpoint` label values of requests_total: route templates are a handful, so hitting
    # this means a raw path leaked into the label (a programming error that would grow series forever).
    max_endpoints: int = 32

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_buckets"):
                object.__setattr__(self, f.name, _edges(f.name, getattr(self, f.name)))
        n = self.max_endpoints
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MetricsConfigError(f"max_endpoints must be a positive integer, got {self.max_endpoints!r}")

    @classmethod
    def with_latency_buckets(cls, edges: tuple[float, ...]) -> MetricsConfig:
        """One edge list for all six latency histograms (TTFT, inter-token, request duration, queue
        wait, prefill, decode step); compile and occupancy edges keep their defaults."""
        return cls(
            ttft_buckets=edges,
            inter_token_buckets=edges,
            request_duration_buckets=edges,
            queue_wait_buckets=edges,
            prefill_buckets=edges,
            decode_step_buckets=edges,
        )


def _edges(name: str, value: object) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise MetricsConfigError(f"{name} must be a sequence of numbers, got {value!r}")
    edges = tuple(value)
    if not edges:
        raise MetricsConfigError(f"{name} must not be empty")
    for v in edges:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise MetricsConfigError(f"{name} holds {v!r}; every edge must be a number")
        if not math.isfinite(v) or v <= 0:
            # +Inf is added by prometheus-client; an explicit one would duplicate it.
            raise MetricsConfigError(f"{name} holds {v!r}; every edge must be positive and finite")
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise MetricsConfigError(f"{name} {list(edges)} must be strictly increasing")
    return tuple(float(v) for v in edges)


def prompt_length_edges(table: BucketTable) -> tuple[float, ...]:
    """Edges for the prompt-length histogram, fine enough to plan a new bucket table from: every power
    of two, the integer halfway point between consecutive powers (3, 6, 12, 24, ...), every length
    bucket of the table and the context length; all up to the context length."""
    limit = table.context_length
    edges = set(table.lengths) | {limit}
    p = 1
    while p <= limit:
        edges.add(p)
        if p >= 2 and p + p // 2 <= limit:  # 1.5 would be no edge for an integer length
            edges.add(p + p // 2)
        p *= 2
    return tuple(float(e) for e in sorted(edges))


def info_labels(given: dict[str, str], table: BucketTable) -> dict[str, str]:
    """Labels of bucketserve_info: the caller's model and runtime facts, the package version unless
    given, and the bucket lists of the table (never from the caller: sizes come from the table only)."""
    missing = [k for k in INFO_REQUIRED if k not in given]
    if missing:
        raise ValueError(f"info lacks {missing}; it needs {list(INFO_REQUIRED)}")
    clash = [k for k in INFO_FROM_TABLE if k in given]
    if clash:  # bucket sizes come from the table only
        raise ValueError(f"info must not set {clash}; they are taken from the bucket table")
    bad = {k: v for k, v in given.items() if not isinstance(v, str)}
    if bad:
        raise ValueError(f"info values must be strings, got {bad!r}")
    out = dict(given)
    if "version" not in out:
        try:
            out["version"] = importlib.metadata.version("bucketserve")
        except importlib.metadata.PackageNotFoundError:  # running from a source checkout
            out["version"] = "unknown"
    out["lengths"] = ",".join(map(str, table.lengths))
    out["batch_sizes"] = ",".join(map(str, table.batch_sizes))
    out["prefill_batch_sizes"] = ",".join(map(str, table.prefill_batch_sizes))
    out["kv_lengths"] = ",".join(map(str, table.kv_lengths))
    out["context_length"] = str(table.context_length)
    return out
