"""Prometheus metrics: every series bucketserve exports, and the hooks the engine and HTTP layer call (the
compilation series and their hooks: server/metrics/compile_series.py).

All metrics live on a registry the app passes in (never the global default), are prefixed
`bucketserve_`, use base units (seconds, tokens, ratios) and, for counters, end in `_total`.
Labels stay bounded: bucket labels come from the `BucketTable`, reasons from the fixed tuples in
server/metrics/config.py, and a value outside them raises ValueError (a programming error, not bad
user input).
Every labelled child is resolved once at construction (so the series exist at 0 from the first scrape
and a hook is a dict lookup plus one lock-protected add) except `requests_total`, whose route
templates are resolved on first use and capped by `MetricsConfig.max_endpoints`.
"""

from __future__ import annotations

import threading
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from buckets import BucketTable, GraphKey
from server.metrics.compile_series import PREFIX, CompileSeries, check_count, check_seconds, pick
from server.metrics.config import (
    ABORT_REASONS,
    FINISH_REASONS,
    REJECT_REASONS,
    MetricsConfig,
    MetricsConfigError,
    info_labels,
    prompt_length_edges,
)

__all__ = ["Metrics", "MetricsConfig", "MetricsConfigError", "prompt_length_edges"]


class Metrics(CompileSeries):
    """Owns every bucketserve metric on `registry`; see the Metrics section of README.md for the series."""

    def __init__(
        self,
        registry: CollectorRegistry,
        table: BucketTable,
        *,
        info: dict[str, str],
        latency_buckets: tuple[float, ...] | None = None,
        config: MetricsConfig | None = None,
        world_size: int = 1,
    ) -> None:
        if latency_buckets is not None and config is not None:
            raise MetricsConfigError("give latency_buckets or config, not both")
        if config is None:
            config = MetricsConfig() if latency_buckets is None else MetricsConfig.with_latency_buckets(latency_buckets)
        self.registry = registry
        self.table = table
        self.config = config
        self._lock = threading.Lock()  # guards the lazily grown requests_total children only

        def counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=registry)

        def histogram(name: str, doc: str, edges: tuple[float, ...], labels: Iterable[str] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=registry, buckets=edges)

        lengths = table.request_lengths  # request buckets: length buckets, then chunk multiples
        graph_keys = list(table.graph_keys())
        self._prefill_keys = frozenset(k for k in graph_keys if k.phase == "prefill")
        self._chunk_keys = frozenset(k for k in graph_keys if k.phase == "chunk")
        self._mixed_keys = frozenset(k for k in graph_keys if k.phase in ("mixed", "verify"))
        self._batch_sizes = frozenset(table.batch_sizes)

        self._init_compile_series(registry, table, config, world_size, counter, gauge, histogram)

        # -- shapes --------------------------------------------------------------------------------
        bucket_requests = counter("bucket_requests_total", "Admitted sequences per length bucket (a request "
                                  "with n choices or a prompt list counts each).", ("bucket",))
        self._bucket_requests = {n: bucket_requests.labels(str(n)) for n in lengths}
        self._prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of admitted sequences (each is "
                                      "prefilled: n choices count their prompt n times).")
        # vLLM's pair (prefix_cache_queries / prefix_cache_hits), in tokens: hits / queries is the hit rate.
        self._prefix_queries = counter("prefix_cache_queries_total", "Prompt tokens of sequences started while "
                                       "prefix caching is on (each looked up in the slots).")
        self._prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens whose K/V a slot already held "
                                    "(a free slot, or a running request's; not computed again).")
        # vLLM's pair (spec_decode_num_draft_tokens / _num_accepted_tokens): accepted / drafts is the acceptance rate.
        self._drafts = counter("spec_decode_num_draft_tokens_total", "Draft tokens verify steps checked "
                               "(speculative decoding).")
        self._accepted = counter("spec_decode_num_accepted_tokens_total", "Draft tokens verify steps accepted "
                                 "(each a token that cost no step of its own).")
        padding = counter("padding_tokens_total", "Pad tokens computed, by phase.", ("phase",))
        self._padding_prefill = padding.labels("prefill")
        self._padding_decode = padding.labels("decode")
        self._over_limit = counter("requests_over_limit_total", "Requests refused for exceeding the length limits.")
        self._occupancy = histogram(
            "batch_occupancy", "Active rows / batch bucket per decode step.", config.occupancy_buckets
        )
        self._prompt_length = histogram(
            "prompt_length", "Prompt length in tokens of admitted requests.", prompt_length_edges(table)
        )

        # -- latency (seconds since arrival at the server unless stated) -----------------------
        ttft = histogram("time_to_first_token_seconds", "Time to first token.", config.ttft_buckets, ("bucket",))
        self._ttft = {n: ttft.labels(str(n)) for n in lengths}
        self._itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive output token deliveries (one a step).",
            config.inter_token_buckets
        )
        duration = histogram(
            "request_duration_seconds", "Arrival to last token.", config.request_duration_buckets, ("bucket",)
        )
        self._duration = {n: duration.labels(str(n)) for n in lengths}
        self._queue_wait = histogram("queue_wait_seconds", "Arrival to prefill start.", config.queue_wait_buckets)
        self._prefill_seconds = histogram("prefill_seconds", "Seconds per prefill graph call.", config.prefill_buckets)
        self._decode_step = histogram(
            "decode_step_seconds", "Seconds per decode graph call.", config.decode_step_buckets
        )
        self._mixed_step = histogram(
            "mixed_step_seconds", "Seconds per mixed graph call (decoding rows and prompt tokens together).",
            config.prefill_buckets,
        )
        self._mixed_rows = counter("mixed_decode_rows_total", "Decoding rows carried by mixed steps.")
        self._decode_stall = histogram(
            "decode_stall_seconds", "Seconds decoding rows waited behind one prefill or chunk step.",
            config.decode_step_buckets,
        )
        self._prefill_chunks = histogram(
            "prefill_chunks", "Prefill graph calls per request (1 unless its prompt was chunked).",
            tuple(float(n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)),
        )

        # -- load ----------------------------------------------------------------------------------
        self._running = gauge("requests_running", "Requests holding a KV slot.")
        self._waiting = gauge("requests_waiting", "Requests queued for a slot.")
        self._slots_free = gauge("slots_free", "Free KV-cache slots.")
        self._http_family = counter("requests_total", "HTTP responses by route and status.", ("endpoint", "status"))
        self._http: dict[tuple[str, int], Counter] = {}
        self._endpoints: set[str] = set()
        rejected = counter("requests_rejected_total", "Requests refused before admission.", ("reason",))
        self._rejected = {r: rejected.labels(r) for r in REJECT_REASONS}
        aborted = counter("requests_aborted_total", "Requests ended early.", ("reason",))
        self._aborted = {r: aborted.labels(r) for r in ABORT_REASONS}
        finished = counter("requests_finished_total", "Requests finished, by finish reason.", ("finish_reason",))
        self._finished = {r: finished.labels(r) for r in FINISH_REASONS}
        self._generation_tokens = counter("generation_tokens_total", "Output tokens generated.")

        Info(PREFIX.rstrip("_"), "Model, runtime and bucket table.", registry=registry).info(info_labels(info, table))

    # -- engine thread: compilation -------------------------------------------------------------
    # -- engine thread: steps and requests -----------------------------------------------------
    def prefill_done(self, key: GraphKey, rows: int, padding_tokens: int, seconds: float) -> None:
        """`padding_tokens` = sum(bucket - prompt_len) over real rows + bucket * pad rows."""
        if key not in self._prefill_keys:
            raise ValueError(f"{key} is not a prefill graph of the bucket table")
        check_count("rows", rows, 1, key.batch)
        self._prefill_call(padding_tokens, key.batch * key.length - rows, seconds)

    def chunk_done(self, key: GraphKey, padding_tokens: int, seconds: float) -> None:
        """One chunk graph call of a chunked prefill; `padding_tokens` pad the last chunk of a prompt."""
        if key not in self._chunk_keys:
            raise ValueError(f"{key} is not a chunk graph of the bucket table")
        self._prefill_call(padding_tokens, self.table.chunk_length - 1, seconds)

    def _prefill_call(self, padding_tokens: int, max_padding: int, seconds: float) -> None:
        """Prefill and chunk calls share the padding counter and the seconds histogram."""
        check_count("padding_tokens", padding_tokens, 0, max_padding)
        check_seconds("seconds", seconds)
        if padding_tokens:
            self._padding_prefill.inc(padding_tokens)
        self._prefill_seconds.observe(seconds)

    def mixed_done(self, key: GraphKey, decode_rows: int, padding_tokens: int, seconds: float) -> None:
        """One mixed graph call of token bucket key.length carrying `decode_rows` decoding rows; its padding
        tokens count as prefill padding."""
        if key not in self._mixed_keys:
            raise ValueError(f"{key} is not a mixed graph of the bucket table")
        check_count("decode_rows", decode_rows, 0, min(key.batch, key.length - 1))
        check_count("padding_tokens", padding_tokens, 0, key.length - 1)
        check_seconds("seconds", seconds)
        if padding_tokens:
            self._padding_prefill.inc(padding_tokens)
        self._mixed_rows.inc(decode_rows)
        self._mixed_step.observe(seconds)

    def decode_stalled(self, seconds: float) -> None:
        """Decoding rows waited `seconds` for a prefill or chunk step between two of their tokens."""
        check_seconds("seconds", seconds)
        self._decode_stall.observe(seconds)

    def prefill_chunks(self, chunks: int) -> None:
        check_count("chunks", chunks, 1)
        self._prefill_chunks.observe(chunks)

    def decode_step_done(self, batch: int, active: int, seconds: float, padding_rows: int) -> None:
        """One decode graph call on batch bucket `batch` with `active` real rows; every pad row costs
        one computed token."""
        if batch not in self._batch_sizes:
            raise ValueError(f"batch {batch!r} is not one of the batch buckets {list(self.table.batch_sizes)}")
        check_count("active", active, 0, batch)
        check_count("padding_rows", padding_rows, 0, batch - active)
        check_seconds("seconds", seconds)
        if padding_rows:
            self._padding_decode.inc(padding_rows)
        self._occupancy.observe(active / batch)
        self._decode_step.observe(seconds)

    def request_started(self, bucket: int, queue_seconds: float) -> None:
        pick(self._ttft, bucket, "length bucket")  # validates the label like the other request hooks
        check_seconds("queue_seconds", queue_seconds)
        self._queue_wait.observe(queue_seconds)

    def first_token(self, bucket: int, seconds: float) -> None:
        child = pick(self._ttft, bucket, "length bucket")
        check_seconds("seconds", seconds)
        child.observe(seconds)

    def request_finished(
        self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float], finish_reason: str
    ) -> None:
        """Once per prefilled request (aborted and failed ones too): duration, output tokens, the gaps
        between its consecutive tokens, and its finish reason ("stop" | "length" | "abort" | "error")."""
        duration = pick(self._duration, bucket, "length bucket")
        finished = pick(self._finished, finish_reason, "finish reason")
        check_seconds("seconds", seconds)
        check_count("output_tokens", output_tokens)
        duration.observe(seconds)
        if output_tokens:
            self._generation_tokens.inc(output_tokens)
        itl = self._itl
        for gap in inter_token:
            itl.observe(gap)
        finished.inc()

    def set_load(self, running: int, waiting: int, slots_free: int) -> None:
        check_count("running", running)
        check_count("waiting", waiting)
        check_count("slots_free", slots_free)
        self._running.set(running)
        self._waiting.set(waiting)
        self._slots_free.set(slots_free)

    def request_aborted(self, reason: str) -> None:
        pick(self._aborted, reason, "abort reason").inc()

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        check_count("prompt_tokens", prompt_tokens, 1)
        check_count("cached_tokens", cached_tokens, 0, prompt_tokens - 1)
        self._prefix_queries.inc(prompt_tokens)
        self._prefix_hits.inc(cached_tokens)

    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None:
        check_count("draft_tokens", draft_tokens, 1)
        check_count("accepted_tokens", accepted_tokens, 0, draft_tokens)
        self._drafts.inc(draft_tokens)
        self._accepted.inc(accepted_tokens)

    # -- HTTP layer ---------------------------------------------------------------------------------
    def request_admitted(self, bucket: int, prompt_tokens: int) -> None:
        child = pick(self._bucket_requests, bucket, "length bucket")
        check_count("prompt_tokens", prompt_tokens, 1, bucket)
        child.inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._prompt_length.observe(prompt_tokens)

    def request_rejected(self, reason: str) -> None:
        pick(self._rejected, reason, "reject reason").inc()

    def request_over_limit(self) -> None:
        self._over_limit.inc()

    def http_request(self, endpoint: str, status: int) -> None:
        """One HTTP response. `endpoint` is the route template ("/v1/completions"), never a raw path."""
        child = self._http.get((endpoint, status))
        if child is None:
            child = self._new_http_child(endpoint, status)
        child.inc()

    def _new_http_child(self, endpoint: str, status: int) -> Counter:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ValueError(f"status must be an HTTP status code, got {status!r}")
        if not isinstance(endpoint, str) or not endpoint.startswith("/") or "?" in endpoint:
            raise ValueError(f"endpoint must be a route template such as '/v1/completions', got {endpoint!r}")
        with self._lock:
            if endpoint not in self._endpoints and len(self._endpoints) >= self.config.max_endpoints:
                raise ValueError(
                    f"endpoint {endpoint!r} would exceed max_endpoints={self.config.max_endpoints} distinct "
                    f"routes; pass the route template, not the request path"
                )
            self._endpoints.add(endpoint)
            child = self._http_family.labels(endpoint, str(status))
            self._http[(endpoint, status)] = child
            return child

    # -- exposition -------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """Body and Content-Type for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
