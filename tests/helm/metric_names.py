"""Every metric the server exports on /metrics, as the exposition names them, with its type and labels.

The dashboard test checks the chart's Grafana dashboard against this list; a server test checks /metrics exports
all of it. Counters carry their `_total` suffix and the info metric its `_info` suffix, as they appear on the
wire; histograms appear as `<name>_bucket`, `<name>_sum` and `<name>_count`.
"""

from __future__ import annotations

PREFIX = "bucketserve_"

# name -> (type, label names other than `le`)
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    # compilation and warm-up
    "bucketserve_graph_compilations_total": ("counter", ("graph", "bucket", "phase")),
    "bucketserve_recompilations_total": ("counter", ("reason",)),
    "bucketserve_compile_seconds": ("histogram", ()),
    "bucketserve_warmup_seconds": ("gauge", ()),
    "bucketserve_graphs": ("gauge", ()),
    "bucketserve_graphs_ready": ("gauge", ()),
    "bucketserve_ready": ("gauge", ()),
    "bucketserve_compile_cache_hits_total": ("counter", ()),
    "bucketserve_compile_cache_misses_total": ("counter", ()),
    "bucketserve_rank_compilations": ("gauge", ("rank", "phase")),  # per tensor-parallel rank (rank 0 alone: TP=1)
    "bucketserve_compile_artifacts_rejected_total": ("counter", ("reason",)),
    # shapes and padding
    "bucketserve_bucket_requests_total": ("counter", ("bucket",)),
    "bucketserve_prompt_tokens_total": ("counter", ()),
    "bucketserve_padding_tokens_total": ("counter", ("phase",)),
    "bucketserve_requests_over_limit_total": ("counter", ()),
    "bucketserve_prefix_cache_queries_total": ("counter", ()),
    "bucketserve_prefix_cache_hits_total": ("counter", ()),
    "bucketserve_spec_decode_num_draft_tokens_total": ("counter", ()),
    "bucketserve_spec_decode_num_accepted_tokens_total": ("counter", ()),
    "bucketserve_batch_occupancy": ("histogram", ()),
    "bucketserve_prompt_length": ("histogram", ()),
    # latency
    "bucketserve_time_to_first_token_seconds": ("histogram", ("bucket",)),
    "bucketserve_inter_token_latency_seconds": ("histogram", ()),
    "bucketserve_request_duration_seconds": ("histogram", ("bucket",)),
    "bucketserve_queue_wait_seconds": ("histogram", ()),
    "bucketserve_prefill_seconds": ("histogram", ()),
    "bucketserve_decode_step_seconds": ("histogram", ()),
    "bucketserve_decode_stall_seconds": ("histogram", ()),
    "bucketserve_mixed_step_seconds": ("histogram", ()),
    "bucketserve_mixed_decode_rows_total": ("counter", ()),
    "bucketserve_prefill_chunks": ("histogram", ()),
    # load
    "bucketserve_requests_running": ("gauge", ()),
    "bucketserve_requests_waiting": ("gauge", ()),
    "bucketserve_slots_free": ("gauge", ()),
    # requests
    "bucketserve_requests_total": ("counter", ("endpoint", "status")),
    "bucketserve_requests_rejected_total": ("counter", ("reason",)),
    "bucketserve_requests_aborted_total": ("counter", ("reason",)),
    # not in the original issue's list, but server/metrics/prometheus.py exports it
    "bucketserve_requests_finished_total": ("counter", ("finish_reason",)),
    "bucketserve_generation_tokens_total": ("counter", ()),
    # build and model information (labels are free-form)
    "bucketserve_info": ("info", ()),
}

METRIC_NAMES: tuple[str, ...] = tuple(METRICS)

HISTOGRAMS: frozenset[str] = frozenset(name for name, (kind, _) in METRICS.items() if kind == "histogram")

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def series_names(name: str) -> tuple[str, ...]:
    """The sample names one metric shows on /metrics (histograms expand to three series)."""
    if name in HISTOGRAMS:
        return tuple(name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return (name,)


def metric_of(series: str) -> str | None:
    """The metric a sample name belongs to (`..._seconds_bucket` -> `..._seconds`), or None if it is unknown."""
    if series in METRICS:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and base in HISTOGRAMS:
            return base
    return None
