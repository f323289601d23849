"""A runner's compiled graphs: one function per graph key, compiled (or loaded) on first use during warm-up,
then called by key. Three ways, chosen once from the compile settings:
- inductor without freezing (the CPU default), on a torch with ahead-of-time compile: one AOT-compiled function
  per key, saved as a file in the compile cache and loaded on the next start. Calls go straight to the key's
  function: its guards are checked once, when it is loaded, never per step.
- other backends (neuron, dynamo-eager), freezing (frozen graphs embed their weights and cannot be saved), or a
  torch without AOT compile: torch.compile over each phase's step function, dynamo's guards per call; after
  warm-up a guard failure is a refused recompile (fail-closed), never a compile.
- compiles off: the step functions themselves, eager.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
import types
from typing import Any, Callable

import torch

from models.artifacts import GraphStore, aot_available, aot_compile, label_of, model_fingerprint
from models.compile import (
    CompileAccountant,
    CompileSettings,
    RecompileError,
    compile_step,
    configure_compiler,
    fail_on_recompile,
    resolve_backend,
)

log = logging.getLogger(__name__)
_set_ids = itertools.count()


def fresh_copy(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """A copy of `fn` with its own code object. Dynamo keeps compiled graphs and the recompile budget per
    code object, so each graph set (one per runner) gets graphs and compile counts of its own."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{suffix}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class GraphSet:
    """The graphs of one runner, by graph key (module docstring: how they are compiled, saved and called)."""

    def __init__(self, model: torch.nn.Module, settings: CompileSettings, accountant: CompileAccountant,
                 num_keys: int, fns: dict[str, Callable[..., Any]]) -> None:
        """fns: the step function of each phase (a key's `phase` picks it: prefill, decode, chunk, mixed, sample)."""
        self.model = model
        self.settings = settings
        self.accountant = accountant
        self.aot = settings.backend == "inductor" and not settings.inductor_freezing
        if self.aot and not aot_available():
            log.warning("torch %s has no ahead-of-time compile: graphs compile in this process and are not "
                        "saved (torch 2.13 saves them)", torch.__version__)
            self.aot = False
        self.store = GraphStore(os.path.join(settings.cache_dir, "graphs")) if self.aot and settings.cache_dir \
            else None
        self.fingerprint = model_fingerprint(model) if self.store is not None else ""
        self.built_elsewhere: dict[str, float] = {}  # label -> compile seconds in a builder process
        self.loaded: set[Any] = set()  # keys whose graph came from a saved artifact
        self._graphs: dict[Any, Callable[..., Any]] = {}
        self.fns = dict(fns)
        if settings.compiles:
            configure_compiler(settings, num_keys)
        if settings.compiles and self.aot:
            self._inductor = resolve_backend("inductor")
        elif settings.compiles:
            if settings.backend == "neuron" and settings.cache_dir:
                accountant.probe_dir = settings.cache_dir  # NEFFs land there on a miss
            accountant.cache_enabled = bool(settings.cache_dir)
            backend = accountant.wrap(resolve_backend(settings.backend))
            suffix = str(next(_set_ids))
            self.fns = {phase: compile_step(fresh_copy(fn, suffix), backend) for phase, fn in fns.items()}

    def call(self, key: Any, args: tuple[Any, ...], *, fail_closed: bool, skip_loaded: bool) -> Any:
        """Run the key's graph on (model, *args). fail_closed: a compile would be a recompile after warm-up
        (refused: RecompileError). skip_loaded: a graph just loaded from a sound artifact is not run (warm-up
        on one rank: its guards were checked against these very inputs; returns an empty tensor)."""
        fn = self.fns[key.phase]
        if self.settings.cuda_graphs and key.phase != "sample":
            # A new step: the CUDA graphs may reuse the memory of the last step's outputs (read by then: the
            # sampled ids are on the host); the sampling graph reads this step's logits, so it marks nothing.
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]
        if self.aot:
            with torch.no_grad():
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._prepare(fn, key, args, fail_closed)
                    if skip_loaded and key in self.loaded:
                        return torch.empty(0)  # a restart's warm-up is then only loading (2-3 s saved)
                return graph(self.model, *args)
        # The stance is scoped to these calls (it is process-wide state, and tests run several runners).
        stance = fail_on_recompile() if fail_closed else contextlib.nullcontext()
        try:
            with torch.no_grad(), stance:  # grad mode is thread-local and guarded on: always the same
                return fn(self.model, *args)
        except RuntimeError as exc:
            if "fail_on_recompile" in str(exc) or "Detected recompile" in str(exc):
                self.accountant.refused(key, "guard_failure")
                raise RecompileError(f"graph {key} would recompile after warm-up: {exc}") from exc
            raise

    def _prepare(self, fn: Callable[..., Any], key: Any, args: tuple[Any, ...], fail_closed: bool
                 ) -> Callable[..., Any]:
        """The key's AOT function: loaded from the store when its artifact is sound and fits this model and
        cache (its guards pass on these inputs), else compiled now and saved."""
        if fail_closed:  # the runner refuses unwarmed keys first; never compile while serving fail-closed
            self.accountant.refused(key, "unwarmed_shape")
            raise RecompileError(f"graph {key} was not warmed up; refusing to compile while serving")
        graph = self._load(key, args) if self.store is not None else None
        if graph is None:
            t0 = time.perf_counter()
            graph = aot_compile(fn, self._inductor, (self.model, *args))
            seconds = time.perf_counter() - t0
            self.accountant.record(seconds, cache_hit=False)
            if self.store is not None:
                self.store.save(key, graph, seconds, self.fingerprint)
        # Dispatch is by key and the inputs come from the key's own buffers: no guard evaluation per step.
        graph.disable_guard_check()  # type: ignore[union-attr]
        self._graphs[key] = graph
        return graph

    def _load(self, key: Any, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        assert self.store is not None
        loaded = self.store.load(key, self.fingerprint)
        reason = loaded.reason
        if loaded.fn is not None and not loaded.fn.guard_check(self.model, *args):  # type: ignore[attr-defined]
            reason = "stale: its guards do not match this model or cache"
        elif loaded.fn is not None:
            built = self.built_elsewhere.pop(label_of(key), None)
            # Built by a builder process during this warm-up: a cold compile (a miss), timed there.
            self.accountant.record(loaded.seconds if built is None else built, cache_hit=built is None)
            self.loaded.add(key)
            return loaded.fn
        if reason != "missing":
            self.accountant.rejected(key, reason)
            self.store.remove(key)
        return None
