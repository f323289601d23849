"""The one composition root: settings in, an unstarted engine (and its metrics) out.

`serve`, `precompile`, `generate`, `verify` and the tests all build their model and engine here, so a
setting reaches the engine the same way whichever command runs it.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from buckets import BucketTable
from models.loading import resolve_model_path
from models.mesh import MeshSpec
from server.config import ServerSettings
from server.engine.engine import Engine
from server.engine.model import EngineModel
from server.metrics.hooks import MetricsHooks
from server.metrics.prometheus import Metrics
from server.metrics.safe_hooks import SafeHooks

log = logging.getLogger("bucketserve.serve")


def build_model(settings: ServerSettings, model_path: str | None = None, *, table: BucketTable | None = None,
                hooks: MetricsHooks | None = None, mesh_spec: MeshSpec | None = None) -> EngineModel:
    """The model the engine thread drives, unloaded: path resolved (downloaded if need be), tokenizer, config
    and bucket table read. `table` overrides the settings' table (tests); `hooks` receive its metrics;
    `mesh_spec` makes it one rank of a tensor-parallel mesh."""
    path = model_path or resolve_model_path(settings.model, settings.model_cache_dir or None)
    return EngineModel(settings, path, metrics=hooks, table=table, mesh_spec=mesh_spec)


def build_metrics(settings: ServerSettings, model: EngineModel, registry: CollectorRegistry | None = None) -> Metrics:
    """Every Prometheus series, registered in `registry` (a fresh one by default)."""
    world = model.mesh_spec.world_size if model.mesh_spec is not None else 1
    return Metrics(
        registry or CollectorRegistry(),
        model.table,
        info={"model": model.name, "dtype": model.dtype, "threads": str(model.num_threads), "device": settings.device,
              "compile_backend": settings.compile_backend, "tensor_parallel_size": str(settings.tensor_parallel_size),
              "world_size": str(world)},
        world_size=world,
    )


def engine_for(settings: ServerSettings, model: EngineModel, hooks: MetricsHooks | None = None) -> Engine:
    """The engine over `model`, with the settings' queue limits, timeout and batching policy. Prefix caching
    needs mixed steps (a cached prompt's prefill starts mid-prompt): without them it is off, and the log says so."""
    caching = settings.enable_prefix_caching
    if caching and not (model.table.mixed_tokens and settings.batching == "continuous"):
        log.info("prefix caching is off: it needs mixed steps (continuous batching, --mixed-steps)")
        caching = False
    if settings.num_speculative_tokens and not model.table.draft_rows:
        log.info("speculative decoding is off: it needs mixed steps (continuous batching, --mixed-steps)")
    return Engine(model, max_waiting_requests=settings.max_waiting_requests,
                  max_waiting_tokens=settings.max_waiting_tokens, request_timeout=settings.request_timeout,
                  metrics=hooks, batching=settings.batching, log_prompts=settings.log_prompts,
                  waiting_served_ratio=settings.waiting_served_ratio, prefix_caching=caching,
                  speculative_tokens=settings.num_speculative_tokens if model.table.draft_rows else 0)


def build_engine(settings: ServerSettings, registry: CollectorRegistry | None = None,
                 mesh_spec: MeshSpec | None = None) -> tuple[Engine, Metrics]:
    """Everything the app needs, unstarted: model path resolved, tokenizer and table loaded, metrics registered."""
    model = build_model(settings, mesh_spec=mesh_spec)
    metrics = build_metrics(settings, model, registry)
    model.metrics = SafeHooks(metrics)
    if settings.lengths_file:
        from planner.command import padding_report, read_lengths_file

        log.info("%s", padding_report(model.table, read_lengths_file(settings.lengths_file)))
    return engine_for(settings, model, metrics), metrics
