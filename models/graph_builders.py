"""Builder processes in a cold warm-up: the graphs missing from the store are split between this process and
the builders' workers (round robin over the table's order); this process warms its share first, then loads the
artifacts the builders saved. A builder that fails only means this process compiles its graphs itself.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Protocol

from models.artifacts import GraphStore

log = logging.getLogger(__name__)

# (the keys the builders took, their futures: each built graph's label -> compile seconds)
Pending = tuple[set[Any], list[Future[dict[str, float]]]]


class GraphBuilder(Protocol):
    """Compiles graphs into the runner's store in other processes while the runner compiles its own share."""

    @property
    def workers(self) -> int: ...

    def submit(self, keys: list[Any]) -> Future[dict[str, float]]:
        """Build `keys` into the store; the future gives each built graph's label and compile seconds."""
        ...


def share_out(todo: list[Any], builder: GraphBuilder | None, store: GraphStore | None
              ) -> tuple[list[Any], Pending | None]:
    """The warm-up order (this process's keys first, then the builders') and what the builders took (None: no
    builders, no store, or nothing cold to share)."""
    if builder is None or builder.workers < 1 or store is None:
        return todo, None
    cold = [k for k in todo if not store.has(k)]
    n = builder.workers + 1
    theirs = [k for i, k in enumerate(cold) if i % n]
    if not theirs:
        return todo, None
    futures = [builder.submit(part) for part in (cold[i::n] for i in range(1, n)) if part]
    log.info("warm-up: %d graphs to compile, %d of them in %d builder processes", len(cold), len(theirs),
             len(futures))
    mine = [k for k in todo if k not in theirs]
    return mine + theirs, (set(theirs), futures)


def collect(pending: Pending, built: dict[str, float]) -> None:
    """Wait for the builders and add what they built to `built` (label -> compile seconds); a builder that
    failed only means this process compiles those graphs."""
    keys, futures = pending
    for future in futures:
        try:
            built.update(future.result())
        except Exception as exc:  # noqa: BLE001  the graphs are compiled here instead
            log.error("a graph builder process failed (%s: %s); compiling its graphs here",
                      type(exc).__name__, exc)
    futures.clear()
    keys.clear()
