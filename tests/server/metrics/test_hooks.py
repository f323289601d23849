"""server.metrics.hooks: the typed hook list, the no-op, and the one guard that keeps a metrics failure from
breaking a request."""

from __future__ import annotations

import inspect
import logging

import pytest
from prometheus_client import CollectorRegistry

from buckets import GraphKey
from server.metrics.hooks import MetricsHooks, NoMetrics
from server.metrics.prometheus import Metrics
from server.metrics.safe_hooks import SafeHooks
from tests.support.tiny import TINY_TABLE

NOT_HOOKS = {"render"}  # Metrics' exposition for GET /metrics (ServedMetrics), not a hook


def public_methods(cls: type) -> set[str]:
    """Public methods `cls` defines or inherits from its own bases (Metrics takes the compilation hooks from
    CompileSeries); not those of the protocol it may declare, nor object's."""
    own = [c for c in cls.__mro__ if c is not object and c is not MetricsHooks and c.__module__ != "typing"]
    if cls is MetricsHooks:
        own = [cls]
    return {n for c in own for n, v in vars(c).items() if callable(v) and not n.startswith("_")}


def test_every_hook_is_listed_and_implemented() -> None:
    hooks = public_methods(MetricsHooks)
    assert len(hooks) >= 20
    assert public_methods(Metrics) - NOT_HOOKS == hooks
    assert public_methods(NoMetrics) == hooks
    assert public_methods(SafeHooks) == hooks
    for name in hooks:  # same parameters everywhere
        expected = list(inspect.signature(getattr(MetricsHooks, name)).parameters)
        for cls in (Metrics, NoMetrics, SafeHooks):
            assert list(inspect.signature(getattr(cls, name)).parameters) == expected, (cls, name)


class Exploding(NoMetrics):
    def __init__(self) -> None:
        self.calls = 0

    def request_rejected(self, reason: str) -> None:
        self.calls += 1
        raise RuntimeError("metrics bug")


def test_a_failing_hook_is_logged_once_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    inner = Exploding()
    hooks = SafeHooks(inner)
    with caplog.at_level(logging.ERROR, logger="bucketserve.metrics"):
        for _ in range(3):
            hooks.request_rejected("queue_full")
    assert inner.calls == 3
    assert [r.getMessage() for r in caplog.records] == [
        "metrics hook request_rejected failed (further failures of it are not logged)"]


def test_real_metrics_reject_bad_labels_without_raising() -> None:
    metrics = Metrics(CollectorRegistry(), TINY_TABLE, info={"model": "m", "dtype": "float32", "device": "cpu",
                                                             "compile_backend": "eager"})
    with pytest.raises(ValueError):
        metrics.request_rejected("no such reason")
    hooks = SafeHooks(metrics)
    hooks.request_rejected("no such reason")  # logged, not raised
    hooks.graph_compiled(GraphKey("decode", 999, 999), 0.1, "warmup")
    hooks.request_rejected("queue_full")  # and the hooks keep working
    assert b'bucketserve_requests_rejected_total{reason="queue_full"} 1.0' in metrics.render()[0]


def test_no_metrics_and_an_empty_guard_do_nothing() -> None:
    SafeHooks().request_over_limit()
    SafeHooks(None).set_ready(True)
    NoMetrics().http_request("/health", 200)
