"""The metrics hooks, typed: what the engine and the HTTP layer report, and the guarantee that reporting
never breaks a request.

`MetricsHooks` lists every hook (server.metrics.prometheus.Metrics implements them all, so does a test's
recorder); `NoMetrics` does nothing; `SafeHooks` (server/metrics/safe_hooks.py) wraps any of
them so that reporting never breaks a request.
"""

from __future__ import annotations

from typing import Protocol

from buckets import GraphKey


class MetricsHooks(Protocol):
    """Every hook bucketserve calls; see docs/metrics-hooks.md for what each one records."""

    # -- warm-up and compilation (engine thread) ---------------------------------------------
    def graph_compiled(self, key: GraphKey, seconds: float, phase: str) -> None: ...
    def recompiled(self, reason: str) -> None: ...
    def warmup_progress(self, done: int, total: int) -> None: ...
    def warmup_finished(self, seconds: float) -> None: ...
    def set_ready(self, ready: bool) -> None: ...
    def artifact_rejected(self, reason: str) -> None: ...
    def compile_cache(self, hit: bool) -> None: ...
    def rank_compilations(self, rank: int, warmup: int, serving: int) -> None: ...

    # -- steps and requests (engine thread) --------------------------------------------------
    def prefill_done(self, key: GraphKey, rows: int, padding_tokens: int, seconds: float) -> None: ...
    def chunk_done(self, key: GraphKey, padding_tokens: int, seconds: float) -> None: ...
    def mixed_done(self, key: GraphKey, decode_rows: int, padding_tokens: int, seconds: float) -> None: ...
    def decode_stalled(self, seconds: float) -> None: ...
    def prefill_chunks(self, chunks: int) -> None: ...
    def decode_step_done(self, batch: int, active: int, seconds: float, padding_rows: int) -> None: ...
    def request_started(self, bucket: int, queue_seconds: float) -> None: ...
    def first_token(self, bucket: int, seconds: float) -> None: ...
    def request_finished(self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float],
                         finish_reason: str) -> None: ...
    def set_load(self, running: int, waiting: int, slots_free: int) -> None: ...
    def request_aborted(self, reason: str) -> None: ...
    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None: ...
    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None: ...

    # -- HTTP layer (event loop) -------------------------------------------------------------
    def request_admitted(self, bucket: int, prompt_tokens: int) -> None: ...
    def request_rejected(self, reason: str) -> None: ...
    def request_over_limit(self) -> None: ...
    def http_request(self, endpoint: str, status: int) -> None: ...


class ServedMetrics(MetricsHooks, Protocol):
    """The hooks plus the exposition GET /metrics serves."""

    def render(self) -> tuple[bytes, str]: ...


class NoMetrics:
    """Every hook, doing nothing (an engine or model built without metrics)."""

    def graph_compiled(self, key: GraphKey, seconds: float, phase: str) -> None:
        return None

    def recompiled(self, reason: str) -> None:
        return None

    def warmup_progress(self, done: int, total: int) -> None:
        return None

    def warmup_finished(self, seconds: float) -> None:
        return None

    def set_ready(self, ready: bool) -> None:
        return None

    def artifact_rejected(self, reason: str) -> None:
        return None

    def compile_cache(self, hit: bool) -> None:
        return None

    def rank_compilations(self, rank: int, warmup: int, serving: int) -> None:
        return None

    def prefill_done(self, key: GraphKey, rows: int, padding_tokens: int, seconds: float) -> None:
        return None

    def chunk_done(self, key: GraphKey, padding_tokens: int, seconds: float) -> None:
        return None

    def mixed_done(self, key: GraphKey, decode_rows: int, padding_tokens: int, seconds: float) -> None:
        return None

    def decode_stalled(self, seconds: float) -> None:
        return None

    def prefill_chunks(self, chunks: int) -> None:
        return None

    def decode_step_done(self, batch: int, active: int, seconds: float, padding_rows: int) -> None:
        return None

    def request_started(self, bucket: int, queue_seconds: float) -> None:
        return None

    def first_token(self, bucket: int, seconds: float) -> None:
        return None

    def request_finished(self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float],
                         finish_reason: str) -> None:
        return None

    def set_load(self, running: int, waiting: int, slots_free: int) -> None:
        return None

    def request_aborted(self, reason: str) -> None:
        return None

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        return None

    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None:
        return None

    def request_admitted(self, bucket: int, prompt_tokens: int) -> None:
        return None

    def request_rejected(self, reason: str) -> None:
        return None

    def request_over_limit(self) -> None:
        return None

    def http_request(self, endpoint: str, status: int) -> None:
        return None

