"""The warm-up's runs: each graph called once with dummy inputs of its shape, in the order given, so that it is
compiled (or loaded) before the server reports ready (models/runner.py's `warmup` calls this; the order and the
sharing-out between this process and a builder's workers are the runner's).

Why a dummy run rather than a compile call: a graph is compiled by its first call, with the inputs a real step
passes (the same shapes, dtypes and strides), so the warm-up goes through the runner's own step methods.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from models.graph_builder import Pending, collect
from models.step_functions import PrefillRow

if TYPE_CHECKING:
    from models.runner import ModelRunner


class WarmupCancelled(RuntimeError):
    """The warm-up was asked to stop (shutdown during start-up)."""


def warm_each(runner: ModelRunner, todo: list[Any], pending: Pending | None,
              progress: Callable[[Any, float, int, int], None] | None,
              cancelled: Callable[[], bool] | None) -> None:
    """Run each graph of `todo` (graph keys) once; a key in `pending` (a builder's share) is loaded from the
    artifacts the builder wrote, once they are there. `progress(key, seconds, done, total)` after each;
    `cancelled()` before each (WarmupCancelled: a shutdown waits for one graph, not the table)."""
    for done, key in enumerate(todo, 1):
        if cancelled is not None and cancelled():
            raise WarmupCancelled(f"warm-up cancelled after {done - 1} of {len(todo)} graphs")
        if pending and key in pending[0]:
            collect(pending, runner.graphs.built_elsewhere)
        t0 = time.perf_counter()
        if key.phase == "decode":
            zeros = torch.zeros(key.batch, dtype=torch.long)
            runner._run_decode(key.batch, key.length, zeros, zeros)
        elif key.phase == "sample":
            runner._run_sample(torch.zeros(key.batch, runner.vocab_size, dtype=runner.dtype, device=runner.device))
        elif key.phase == "chunk":
            # Slot 0 from position c: what the warm-up's dummy writes there, no request reads.
            runner._run_chunk(key.length, 0, runner.table.chunk_length, [0])
        elif key.phase in ("mixed", "verify"):
            runner._run_mixed(key.length, [0], [0], [0], [0], key.batch)
        else:
            runner._run_prefill(key.batch, key.length, [PrefillRow(0, [0])] * key.batch, commit=False)
        runner.warmed.add((key.phase, key.batch, key.length))
        if progress is not None:
            progress(key, time.perf_counter() - t0, done, len(todo))
