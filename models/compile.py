"""Compile backends and compile accounting.

Every compilation passes through `CompileAccountant.backend`, a wrapper around the real backend
(inductor, TorchNeuron's "neuron", or dynamo's "eager" for tests), so each one is recorded with the graph
key the runner is executing, its seconds and whether it happened during warm-up or while serving.
After warm-up the default policy is fail-closed: dynamo's stance is set to "fail_on_recompile", so a
recompile raises instead of compiling silently, and fullgraph=True means no silent eager fallback.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch

log = logging.getLogger(__name__)

CompilePhase = Literal["warmup", "serving"]
# "eager": no compilation at all, same static shapes. "dynamo-eager": dynamo captures and guards graphs
# but runs them eagerly (fast, for tests of the accounting and the no-recompile guarantees).
BACKENDS = ("inductor", "eager", "neuron", "dynamo-eager")
QUANTIZE_MODES = ("none", "int8")  # none | weight-only int8 for steps of 1-128 rows (models/prepack.py)


class RecompileError(RuntimeError):
    """A graph would compile after warm-up while the policy forbids it."""


@dataclass(frozen=True)
class CompileSettings:
    backend: str = "inductor"
    recompile_policy: str = "error"  # error | allow
    cache_dir: str = ""  # persistent compile cache; "" -> the backend's default
    inductor_freezing: bool = False  # faster on CPU, but frozen graphs bypass the persistent cache
    # CPU linears through prepacked oneDNN weights (models/prepack.py; float32: steps of 2+ rows); ignored where unsupported,
    # under freezing (which packs inside the graph) and on the Neuron backend.
    weight_prepack: bool = True
    # CPU: bucketserve's own kernels (models/native.py) for decoding rows' attention (bf16 and fp32) and bf16
    # linears of 1-4 rows; SDPA and oneDNN where they do not apply.
    native_kernels: bool = True
    # CPU bf16 with AMX: "int8" runs steps of 1-128 rows on weight-only int8 copies of the linears (prepack.py).
    quantize: str = "none"
    # CUDA with inductor: each graph replays as one CUDA graph (inductor's cudagraph trees; the static cache's
    # buffers are marked static addresses) instead of one launch per kernel; a no-op for CPU graphs.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"compile backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.recompile_policy not in ("error", "allow"):
            raise ValueError(f"recompile_policy must be 'error' or 'allow', got {self.recompile_policy!r}")

    @property
    def compiles(self) -> bool:
        return self.backend != "eager"


@dataclass(frozen=True)
class CompileRecord:
    key: Any  # buckets.GraphKey (models does not import buckets; the runner passes the key through)
    seconds: float
    phase: CompilePhase
    cache_hit: bool | None = None  # None: the backend tells us nothing about its cache


def _cache_counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
    return hits, misses


@dataclass
class CompileAccountant:
    """Counts compilations per graph key. `on_compile(record)` lets the server export metrics."""

    on_compile: Callable[[CompileRecord], None] | None = None
    # Called when a compile after warm-up was refused (policy "error"): (graph key, reason). The attempt
    # is the alert signal even though nothing compiled.
    on_refused: Callable[[Any, str], None] | None = None
    # Called when a saved graph artifact was found unusable and is rebuilt: (graph key, reason).
    on_rejected: Callable[[Any, str], None] | None = None
    records: list[CompileRecord] = field(default_factory=list)
    phase: CompilePhase = "warmup"
    current_key: Any = None
    # For backends with no cache counters (TorchNeuron): a compile that adds no file to this directory was
    # served from its cache. "" -> no probe.
    probe_dir: str = ""
    # A persistent cache is configured: a compile that loaded nothing from it (no cache counter moved, no
    # probe) is a miss, e.g. inductor with freezing, whose graphs bypass the FX graph cache.
    cache_enabled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            hits, misses = _cache_counters()
            files = _count_files(self.probe_dir)
            start = time.perf_counter()
            compiled = inner(gm, example_inputs)
            seconds = time.perf_counter() - start
            new_hits, new_misses = _cache_counters()
            hit = None
            if new_hits > hits or new_misses > misses:
                hit = new_misses == misses
            elif self.probe_dir:
                hit = _count_files(self.probe_dir) == files
            elif self.cache_enabled:
                hit = False
            self.record(seconds, hit)
            return compiled

        return backend

    def record(self, seconds: float, cache_hit: bool | None = None) -> None:
        rec = CompileRecord(self.current_key, seconds, self.phase, cache_hit)
        with self._lock:
            self.records.append(rec)
        if self.phase == "serving":
            log.warning("graph %s compiled after warm-up (%.1f s)", rec.key, seconds)
        if self.on_compile is not None:
            self.on_compile(rec)

    def refused(self, key: Any, reason: str) -> None:
        log.error("refused to compile graph %s after warm-up (%s)", key, reason)
        if self.on_refused is not None:
            self.on_refused(key, reason)

    def rejected(self, key: Any, reason: str) -> None:
        log.warning("compiled graph artifact for %s not used (%s); compiling it again", key, reason)
        if self.on_rejected is not None:
            self.on_rejected(key, reason)

    def count(self, phase: CompilePhase | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.records if phase is None or r.phase == phase)


def _count_files(root: str) -> int:
    return sum(len(names) for _, _, names in os.walk(root)) if root else 0


def configure_compiler(settings: CompileSettings, num_graphs: int) -> None:
    """Process-wide compiler settings, applied once at start-up (never at import)."""
    import torch._dynamo.config as dynamo_config

    # One graph per bucket on one code object: the default limit of 8 would make the 9th bucket fall
    # back (fullgraph turns that into a hard error); leave generous room for allowed recompiles.
    limit = max(64, 4 * num_graphs)
    dynamo_config.recompile_limit = limit
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4 * limit)
    dynamo_config.automatic_dynamic_shapes = False  # static shapes only: never a dynamic graph
    if settings.backend == "inductor":
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        inductor_config.freezing = settings.inductor_freezing
        inductor_config.triton.cudagraphs = settings.cuda_graphs
        # Round intermediates to the graph's dtype where eager rounds them: without it, bfloat16 graphs differ
        # from eager bfloat16 enough to flip near-tie argmaxes (SmolLM2's first answer token to "What is the
        # capital of France?": eager "The" 25.625 vs "L" 25.5; inductor 25.25 both, picking "L").
        inductor_config.emulate_precision_casts = True
        # No size/stride assert on every input and op output of a graph call: ~460 Python calls a decode step
        # (~0.35 ms of 15, one thread). Our ops' fake kernels declare what their C++ kernels return, and the tests
        # run the graphs against eager.
        inductor_config.size_asserts = False
        if settings.cache_dir:
            # The persistent caches: compiled kernels (FX graph cache) and the traced joint graphs
            # (AOT autograd cache); both key on graph content, torch version and compiler config.
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = settings.cache_dir
            inductor_config.fx_graph_cache = True
            functorch_config.enable_autograd_cache = True
    if settings.backend == "neuron" and settings.cache_dir:
        # TorchNeuron reads its NEFF cache location from this variable.
        os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] = settings.cache_dir


def prewarm_inductor(cache_dir: str) -> threading.Thread:
    """Start inductor's one-time per-process set-up in a thread, to overlap with loading the weights: its
    CPU-ISA probe (a compile-and-dlopen check per vector ISA, each in a child process: 1.5-3 s here) and the
    imports its generated code needs. The caller joins the thread before the first compile or load.
    `cache_dir`: the compile cache (set first, as configure_compiler will: inductor keeps its probes there)."""
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir

    def work() -> None:
        try:
            import torch._inductor.codecache  # noqa: F401
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            pick_vec_isa()  # functools-cached for the process: the warm-up then finds it done
        except Exception:  # noqa: BLE001  the warm-up will meet (and report) the same problem itself
            log.debug("inductor prewarm failed", exc_info=True)

    thread = threading.Thread(target=work, name="bucketserve-inductor-prewarm", daemon=True)
    thread.start()
    return thread


@functools.cache
def graph_code_digest() -> str:
    """A digest of the Python that shapes the compiled graphs (every models/*.py): a bucketserve version that
    traces different graphs gets its own cache directory, rather than loading artifacts built from the old code
    (a saved artifact is only checked against the weights' names and shapes and the torch version)."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(parts: dict[str, Any]) -> str:
    """A directory name that changes whenever anything that shapes a compiled artifact changes: model,
    dtype, device, buckets, backend, thread count, torch and transformers versions, bucketserve's graph code."""
    import transformers

    full = dict(parts, torch=torch.__version__, transformers=transformers.__version__, code=graph_code_digest())
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve_backend(name: str) -> Callable[..., Any]:
    """The callable compile backend for a setting name."""
    from torch._dynamo import lookup_backend

    if name == "inductor":
        return lookup_backend("inductor")
    if name == "dynamo-eager":
        return lookup_backend("eager")
    if name == "neuron":
        try:
            import torch_neuronx  # noqa: F401  registers device "neuron" and backend "neuron"
        except ImportError as exc:
            raise RuntimeError(
                "compile backend 'neuron' needs torch-neuronx (TorchNeuron) on a Trainium host"
            ) from exc
        return lookup_backend("neuron")
    raise ValueError(f"backend {name!r} does not compile")


def compile_step(fn: Callable[..., Any], backend: Callable[..., Any]) -> Callable[..., Any]:
    """Static shapes only: dynamic=False (TorchNeuron rejects dynamic=True), fullgraph=True (a graph break
    is an error, never a silent split into eager pieces)."""
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def fail_on_recompile() -> Any:
    """Context manager: inside it, dynamo raises instead of compiling a graph that is not cached."""
    return torch.compiler.set_stance("fail_on_recompile")
