"""`SafeHooks`: any metrics hooks (server/metrics/hooks.py), with every call guarded.

It has one explicit method per hook, so a misspelt hook is a type error rather than a silent no-op. A hook that
raises (Metrics validates its inputs and raises on a programming error) is logged once per hook name and otherwise
ignored: bookkeeping can never leave a request without its final event, fail a response or stop the engine thread.
This wrapper is the one place that guarantee lives.
"""

from __future__ import annotations

import logging

from buckets import GraphKey
from server.metrics.hooks import MetricsHooks, NoMetrics

log = logging.getLogger("bucketserve.metrics")


class SafeHooks:
    """`hooks` (or nothing), with every call guarded: a failing hook is logged once and ignored."""

    def __init__(self, hooks: MetricsHooks | None = None) -> None:
        self._hooks: MetricsHooks = hooks if hooks is not None else NoMetrics()
        self._failed: set[str] = set()

    @property
    def wrapped(self) -> MetricsHooks:
        return self._hooks

    def _failed_once(self, name: str) -> None:
        """Called from an `except Exception` block (see the module docstring): log the first failure."""
        if name not in self._failed:
            self._failed.add(name)
            log.exception("metrics hook %s failed (further failures of it are not logged)", name)

    def graph_compiled(self, key: GraphKey, seconds: float, phase: str) -> None:
        try:
            self._hooks.graph_compiled(key, seconds, phase)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("graph_compiled")

    def recompiled(self, reason: str) -> None:
        try:
            self._hooks.recompiled(reason)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("recompiled")

    def warmup_progress(self, done: int, total: int) -> None:
        try:
            self._hooks.warmup_progress(done, total)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("warmup_progress")

    def warmup_finished(self, seconds: float) -> None:
        try:
            self._hooks.warmup_finished(seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("warmup_finished")

    def set_ready(self, ready: bool) -> None:
        try:
            self._hooks.set_ready(ready)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("set_ready")

    def artifact_rejected(self, reason: str) -> None:
        try:
            self._hooks.artifact_rejected(reason)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("artifact_rejected")

    def compile_cache(self, hit: bool) -> None:
        try:
            self._hooks.compile_cache(hit)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("compile_cache")

    def rank_compilations(self, rank: int, warmup: int, serving: int) -> None:
        try:
            self._hooks.rank_compilations(rank, warmup, serving)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("rank_compilations")

    def prefill_done(self, key: GraphKey, rows: int, padding_tokens: int, seconds: float) -> None:
        try:
            self._hooks.prefill_done(key, rows, padding_tokens, seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("prefill_done")

    def chunk_done(self, key: GraphKey, padding_tokens: int, seconds: float) -> None:
        try:
            self._hooks.chunk_done(key, padding_tokens, seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("chunk_done")

    def mixed_done(self, key: GraphKey, decode_rows: int, padding_tokens: int, seconds: float) -> None:
        try:
            self._hooks.mixed_done(key, decode_rows, padding_tokens, seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("mixed_done")

    def decode_stalled(self, seconds: float) -> None:
        try:
            self._hooks.decode_stalled(seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("decode_stalled")

    def prefill_chunks(self, chunks: int) -> None:
        try:
            self._hooks.prefill_chunks(chunks)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("prefill_chunks")

    def decode_step_done(self, batch: int, active: int, seconds: float, padding_rows: int) -> None:
        try:
            self._hooks.decode_step_done(batch, active, seconds, padding_rows)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("decode_step_done")

    def request_started(self, bucket: int, queue_seconds: float) -> None:
        try:
            self._hooks.request_started(bucket, queue_seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_started")

    def first_token(self, bucket: int, seconds: float) -> None:
        try:
            self._hooks.first_token(bucket, seconds)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("first_token")

    def request_finished(self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float],
                         finish_reason: str) -> None:
        try:
            self._hooks.request_finished(bucket, seconds, output_tokens, inter_token, finish_reason)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_finished")

    def set_load(self, running: int, waiting: int, slots_free: int) -> None:
        try:
            self._hooks.set_load(running, waiting, slots_free)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("set_load")

    def request_aborted(self, reason: str) -> None:
        try:
            self._hooks.request_aborted(reason)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_aborted")

    def prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        try:
            self._hooks.prefix_cache(prompt_tokens, cached_tokens)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("prefix_cache")

    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None:
        try:
            self._hooks.speculated(draft_tokens, accepted_tokens)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("speculated")

    def request_admitted(self, bucket: int, prompt_tokens: int) -> None:
        try:
            self._hooks.request_admitted(bucket, prompt_tokens)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_admitted")

    def request_rejected(self, reason: str) -> None:
        try:
            self._hooks.request_rejected(reason)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_rejected")

    def request_over_limit(self) -> None:
        try:
            self._hooks.request_over_limit()
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("request_over_limit")

    def http_request(self, endpoint: str, status: int) -> None:
        try:
            self._hooks.http_request(endpoint, status)
        except Exception:  # noqa: BLE001 - see the module docstring
            self._failed_once("http_request")
