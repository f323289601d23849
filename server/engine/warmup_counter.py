"""How far warm-up has come: graphs done of total, seconds so far, and the time left at the pace so far
(what /ready and Retry-After report while the server warms up)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WarmupCounter:
    total: int
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float = 0.0

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def eta(self) -> float:
        if self.done == 0:
            return 30.0
        return self.seconds / self.done * (self.total - self.done)
