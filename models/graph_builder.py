"""Compile graphs in other processes during warm-up, so a cold start uses every core.

Tracing, inductor's scheduling and code generation run in Python under one GIL; the C++ builds already go to
inductor's compile workers. A second process compiling half of the missing graphs into the same store works
in parallel with the first; the serving process then loads its artifacts (about 0.2 s each). Each builder
loads its own copy of the weights (the model is an input of the graphs, so any copy of the same checkpoint
serves) and exits when done.

The split: the graphs missing from the store go round robin to this process and the builders' workers (in the
table's order); this process warms its share first, then loads the artifacts the builders saved. A builder that
fails only means this process compiles its graphs itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from models.artifacts import GraphStore
from models.compile import CompileSettings
from models.hardware import available_memory, processes_that_fit, resident_memory

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


def builders_that_fit(wanted: int) -> int:
    """How many of `wanted` builders memory allows. A builder holds what the serving process holds once its runner
    is built (the weights, the KV cache, the packed copies) and compiles as it does, so each is counted at this
    process's resident size, and together they leave MEMORY_RESERVE free (measured, bf16 default table: a builder
    peaks at ~2.1 GiB, the server at ~2.3). Fewer builders only make a cold start slower; in a container memory
    limit, an OOM kill would take the server."""
    if wanted < 1:
        return 0
    each, free = resident_memory(), available_memory()
    fits = processes_that_fit(wanted, each, free)
    if fits < wanted and each is not None and free is not None:
        log.warning("%d MiB available: %d of %d graph builder processes (each ~%d MiB); a cold warm-up takes longer",
                    free >> 20, fits, wanted, each >> 20)
    return fits


@dataclass(frozen=True)
class BuildSpec:
    """What a builder process needs to rebuild the serving process's runner (picklable)."""

    model_path: str
    dtype: str
    device: str
    table: Any  # the server's bucket table (pickled; models does not import buckets)
    settings: CompileSettings
    num_threads: int


def build_graphs(spec: BuildSpec, keys: list[Any]) -> dict[str, float]:
    """In a builder process: compile `keys` into the store; returns label -> compile seconds."""
    import torch

    from models.artifacts import label_of
    from models.loading import load_model
    from models.runner import ModelRunner

    torch.set_num_threads(spec.num_threads)
    model = load_model(spec.model_path, spec.dtype, spec.device)
    runner = ModelRunner(model, spec.table, spec.settings)
    runner.warmup(keys)
    runner.stop_serving()
    return {label_of(r.key): r.seconds for r in runner.accountant.records if r.cache_hit is False}


def _die_with_parent() -> None:
    """Builder initializer: on Linux, ask the kernel to SIGKILL this process when its parent dies (a server
    killed with SIGKILL cannot stop its builders itself)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ProcessBuilder:
    """A pool of `workers` spawned processes (a fresh interpreter each: no forked torch state). Owned by
    whoever runs the warm-up, and closed by it."""

    def __init__(self, spec: BuildSpec, workers: int) -> None:
        self.spec = spec
        self._workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()  # close() may come from a stopping thread while the warm-up submits

    @property
    def workers(self) -> int:
        return self._workers

    def submit(self, keys: list[Any]) -> Future[dict[str, float]]:
        with self._lock:
            if self._closed:  # cancelled meanwhile: the warm-up compiles these itself, or stops
                refused: Future[dict[str, float]] = Future()
                refused.set_exception(RuntimeError("the graph builder is closed"))
                return refused
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_die_with_parent)
            return self._pool.submit(build_graphs, self.spec, keys)

    def close(self, abandon: bool = False) -> None:
        """Wait for the workers to exit; `abandon`: stop them mid-build (the warm-up failed or was cancelled,
        and a half-built artifact is never written: saves are atomic)."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is None:
            return
        if abandon:
            # The executor has no public way to stop a running task; its worker processes are still ours.
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ProcessBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(abandon=exc_type is not None)
