"""How far warm-up has come: graphs done of total, seconds so far, and the time left at the pace so far
(what /ready and Retry-After report while the server warms up)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WarmupCounter:
    total: int
    done: int = 0
    created: float = field(default_factory=time.monotonic)  # the engine began: model load, then warm-up
    started: float = field(default_factory=time.monotonic)  # warm-up began (set again when it does)
    finished: float = 0.0

    @property
    def seconds(self) -> float:
        """The warm-up's own seconds (graphs only: what precompile reports)."""
        return (self.finished or time.monotonic()) - self.started

    @property
    def elapsed(self) -> float:
        """Seconds since the engine began, model load included, until warm-up ended: what /ready reports. Never
        steps back when warm-up begins (its own clock, `seconds`, restarts there)."""
        return (self.finished or time.monotonic()) - self.created

    def eta(self) -> float:
        if self.done == 0:
            return 30.0
        return self.seconds / self.done * (self.total - self.done)
