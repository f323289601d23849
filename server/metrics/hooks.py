"""Metrics hooks as the engine calls them: never None, and never able to break a request.

A hook that raises (the metrics module validates its inputs and raises on a programming error) is logged
once per hook name and otherwise ignored, so bookkeeping can never leave a request without its final event
or stop the engine thread.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("bucketserve.metrics")


class SafeHooks:
    def __init__(self, metrics: Any = None) -> None:
        self._metrics = metrics
        self._failed: set[str] = set()

    def __getattr__(self, name: str) -> Callable[..., None]:
        hook = getattr(self._metrics, name, None) if self._metrics is not None else None

        def call(*args: Any, **kwargs: Any) -> None:
            if hook is None:
                return
            try:
                hook(*args, **kwargs)
            except Exception:  # noqa: BLE001 - see the module docstring
                if name not in self._failed:
                    self._failed.add(name)
                    log.exception("metrics hook %s failed (further failures of it are not logged)", name)

        return call
