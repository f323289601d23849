"""The compilation series of the Prometheus metrics and their hooks: graphs compiled (per graph, bucket and phase),
recompilations after ready, compile seconds, warm-up progress, readiness, the compile cache, saved artifacts
rejected, and each tensor-parallel rank's compilations. `Metrics` (server/metrics/prometheus.py) inherits them:
one exporter, two modules, each one concern. Also the checks every hook shares (a bad label value or count is a
programming error: ValueError).
"""

from __future__ import annotations

from typing import Callable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from buckets import BucketTable, GraphKey
from server.metrics.config import ARTIFACT_REJECT_REASONS, COMPILE_PHASES, RECOMPILE_REASONS, MetricsConfig

PREFIX = "bucketserve_"

K = TypeVar("K")
V = TypeVar("V")


def pick(children: dict[K, V], key: K, what: str) -> V:
    try:
        return children[key]
    except KeyError:
        raise ValueError(f"{what} {key!r} is not one of {[str(k) for k in children]}") from None


def check_count(name: str, value: int, low: int = 0, high: int | None = None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def check_seconds(name: str, value: float) -> None:
    if not value >= 0:  # also rejects NaN: a monotonic clock never yields one
        raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")


CounterFactory = Callable[..., Counter]
GaugeFactory = Callable[[str, str], Gauge]
HistogramFactory = Callable[..., Histogram]


class CompileSeries:
    """The compilation series on a registry (made by `_init_compile_series`) and the hooks that record them."""

    def _init_compile_series(self, registry: CollectorRegistry, table: BucketTable, config: MetricsConfig,
                             world_size: int, counter: CounterFactory, gauge: GaugeFactory,
                             histogram: HistogramFactory) -> None:
        graph_keys = list(table.graph_keys())
        compilations = counter(
            "graph_compilations_total", "Graphs compiled, by graph, bucket and phase.", ("graph", "bucket", "phase")
        )
        self._compilations = {
            (k, ph): compilations.labels(k.phase, k.bucket, ph) for k in graph_keys for ph in COMPILE_PHASES
        }
        recompiles = counter("recompilations_total", "Compilations after ready (should stay 0).", ("reason",))
        self._recompiles = {r: recompiles.labels(r) for r in RECOMPILE_REASONS}
        self._compile_seconds = histogram("compile_seconds", "Seconds to compile one graph.", config.compile_buckets)
        self._warmup_seconds = gauge("warmup_seconds", "Seconds the warm-up of every graph took.")
        # A gauge: no _total suffix (that is the counters'); bucketserve_graphs_ready counts the warm ones.
        self._graphs_total = gauge("graphs", "Graphs the bucket table needs.")
        self._graphs_ready = gauge("graphs_ready", "Graphs compiled and warmed so far.")
        self._ready = gauge("ready", "1 when every graph is warm and requests are admitted, else 0.")
        self._graphs_total.set(table.num_graphs)
        self._cache_hits = counter("compile_cache_hits_total", "Graphs loaded from the compile cache.")
        self._cache_misses = counter("compile_cache_misses_total", "Graphs not found in the compile cache.")
        # Tensor parallel: each rank's compilations (rank 0's own, the followers' as their heartbeats report).
        rank_compiles = Gauge(PREFIX + "rank_compilations", "Graphs compiled per tensor-parallel rank and phase.",
                              ("rank", "phase"), registry=registry)
        self._rank_compiles = {(r, ph): rank_compiles.labels(str(r), ph)
                               for r in range(world_size) for ph in COMPILE_PHASES}
        rejected = counter("compile_artifacts_rejected_total",
                           "Saved graph artifacts found unusable at warm-up and rebuilt, by reason.", ("reason",))
        self._artifacts_rejected = {r: rejected.labels(r) for r in ARTIFACT_REJECT_REASONS}

    def graph_compiled(self, key: GraphKey, seconds: float, phase: str) -> None:
        """One graph compiled. A compile in phase "serving" must also be reported with `recompiled`."""
        child = self._compilations.get((key, phase))
        if child is None:
            pick({p: p for p in COMPILE_PHASES}, phase, "compile phase")
            raise ValueError(f"graph {key} is not in the bucket table")
        check_seconds("seconds", seconds)
        child.inc()
        self._compile_seconds.observe(seconds)

    def recompiled(self, reason: str) -> None:
        pick(self._recompiles, reason, "recompile reason").inc()

    def warmup_progress(self, done: int, total: int) -> None:
        check_count("total", total, 1)
        check_count("done", done, 0, total)
        self._graphs_total.set(total)
        self._graphs_ready.set(done)

    def warmup_finished(self, seconds: float) -> None:
        check_seconds("seconds", seconds)
        self._warmup_seconds.set(seconds)

    def rank_compilations(self, rank: int, warmup: int, serving: int) -> None:
        check_count("warmup", warmup)
        check_count("serving", serving)
        pick(self._rank_compiles, (rank, "warmup"), "rank").set(warmup)
        self._rank_compiles[(rank, "serving")].set(serving)

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def artifact_rejected(self, reason: str) -> None:
        pick(self._artifacts_rejected, reason, "artifact reject reason").inc()

    def compile_cache(self, hit: bool) -> None:
        (self._cache_hits if hit else self._cache_misses).inc()
