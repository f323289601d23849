"""The model runner: owns the model, the slot cache and one compiled graph per bucket.

All calls come from one thread (the engine thread). Shapes come from the bucket table the server passes in
(duck-typed here: `models` does not import `buckets`); a shape outside it is refused, never compiled.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import time
import types
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from models import native
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
from models.gated_mlp import fuse_gated_mlps
from models.masks import chunk_mask, decode_mask, sliding_window
from models.prepack import prepack
from models.prepack import supported as prepack_supported
from models.rms_norm import swap_rms_norms
from models.rotary_table import tabulate_rotary
from models.sample_graph import SampleInputs, sample_rows
from models.slot_cache import ChunkCache, DecodeCache, MixedCache, PrefillCache, SlotStorage

log = logging.getLogger(__name__)


class ShapeTable(Protocol):
    @property
    def lengths(self) -> tuple[int, ...]: ...
    @property
    def batch_sizes(self) -> tuple[int, ...]: ...
    @property
    def prefill_batch_sizes(self) -> tuple[int, ...]: ...
    @property
    def context_length(self) -> int: ...
    @property
    def max_length(self) -> int: ...
    @property
    def kv_lengths(self) -> tuple[int, ...]: ...

    @property
    def chunk_length(self) -> int: ...
    @property
    def chunk_kv_lengths(self) -> tuple[int, ...]: ...
    @property
    def sample_batch_sizes(self) -> tuple[int, ...]: ...
    @property
    def mixed_tokens(self) -> tuple[int, ...]: ...
    @property
    def mixed_budget(self) -> int: ...
    @property
    def solo_budget(self) -> int: ...

    def kv_for(self, positions: int) -> int: ...

    def mixed_for(self, tokens: int) -> int: ...

    def graph_keys(self) -> Iterable[Any]: ...


class GraphBuilder(Protocol):
    """Compiles graphs into the runner's store in other processes while the runner compiles its own share."""

    @property
    def workers(self) -> int: ...

    def submit(self, keys: list[Any]) -> Future[dict[str, float]]:
        """Build `keys` into the store; the future gives each built graph's label and compile seconds."""
        ...


class WarmupCancelled(RuntimeError):
    """The warm-up was asked to stop (shutdown during start-up)."""


class UnknownShapeError(ValueError):
    """A graph shape that is not in the bucket table: refused, not compiled."""


@dataclass(frozen=True)
class PrefillRow:
    slot: int
    token_ids: list[int]


def _prefill_step(
    model: torch.nn.Module, cache: PrefillCache, input_ids: torch.Tensor, last_idx: torch.Tensor
) -> torch.Tensor:
    """input_ids: [P, L] right-padded; last_idx: [P, 1] index of each row's last real token.
    Returns logits [P, V] at those positions (the lm_head runs on P rows, not P * L)."""
    rows, length = input_ids.shape
    position_ids = torch.arange(length, device=input_ids.device).view(1, length).expand(rows, length)
    out = model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True, logits_to_keep=last_idx)
    logits: torch.Tensor = out.logits[:, 0]
    return logits


def _make_decode_step(dtype: torch.dtype, kinds: list[str], window: int | None) -> Callable[..., torch.Tensor]:
    def _decode_step(
        model: torch.nn.Module, cache: DecodeCache, input_ids: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """input_ids: [b, 1]; pos: [b] per-slot write positions (< cache.kv_length). Returns logits [b, V]."""
        cache.write_pos.copy_(pos)
        mask = decode_mask(pos, cache.kv_length, dtype, kinds, window)
        out = model(input_ids=input_ids, position_ids=pos.view(-1, 1), attention_mask=mask, cache=cache, use_cache=True)
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    return _decode_step


def _make_chunk_step(dtype: torch.dtype, kinds: list[str], window: int | None) -> Callable[..., torch.Tensor]:
    def _chunk_step(
        model: torch.nn.Module, cache: ChunkCache, input_ids: torch.Tensor, slot: torch.Tensor,
        offset: torch.Tensor, last_idx: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids: [1, c] (right-padded chunk); slot, offset: [1] long; last_idx: [1, 1] index of the
        chunk's last real token. Returns logits [1, V] there (used only when the chunk ends the prompt)."""
        cache.slot.copy_(slot)
        cache.offset.copy_(offset)
        chunk = input_ids.shape[1]
        positions = (offset.view(1, 1) + torch.arange(chunk, device=input_ids.device).view(1, chunk))
        mask = chunk_mask(offset, chunk, cache.kv_length, dtype, kinds, window)
        out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                    logits_to_keep=last_idx)
        logits: torch.Tensor = out.logits[:, 0]
        return logits

    return _chunk_step


def _mixed_step(model: torch.nn.Module, cache: MixedCache, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: [1, T] tokens of several slots on one axis; meta: [T, 2] (slot, position) per
    token; keep: [R] indices of the tokens whose logits are wanted. Returns logits [R, V]. The meta tensor goes
    in as the 4-D "mask" (transformers passes 4-D masks through untouched): the attention op reads it."""
    cache.meta.copy_(meta)
    mask = cache.meta.view(1, 1, -1, 2)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                logits_to_keep=keep)
    logits: torch.Tensor = out.logits[0]
    return logits


def _sample_step(model: torch.nn.Module, logits: torch.Tensor, inputs: SampleInputs) -> tuple[torch.Tensor, ...]:
    """The sampling graph (model unused: every step function takes it first)."""
    return sample_rows(logits, inputs)


_runner_ids = itertools.count()


def _vocab_size(model: Any) -> int:
    """Width of the logits: the output embedding's rows (the config's vocab_size when there is none)."""
    out = model.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)


def _fresh_copy(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    """A copy of `fn` with its own code object. Dynamo keeps compiled graphs and the recompile budget per
    code object, so each runner gets graphs (and compile counts) of its own."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{suffix}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        table: ShapeTable,
        compile_settings: CompileSettings,
        accountant: CompileAccountant | None = None,
        tp_size: int = 1,
    ) -> None:
        self.model = model
        self.table = table
        self.settings = compile_settings
        self.accountant = accountant or CompileAccountant()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Packed weights live outside the graphs (the graphs call bucketserve::linear with the plain weight);
        # freezing packs inside the graph instead, Neuron compiles its own matmuls, a TP shard is a DTensor.
        wants_prepack = compile_settings.weight_prepack and not compile_settings.inductor_freezing \
            and compile_settings.backend != "neuron" and tp_size == 1
        native.configure(compile_settings.native_kernels)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            native.available()  # build (once per machine) or load the kernels now, not in the first request's step
        # Rotary cos/sin looked up by position, not recomputed in every layer of every step (models/rotary_table.py).
        self.rotary_tables = tabulate_rotary(model, table.context_length, self.dtype)
        int8 = compile_settings.quantize == "int8"
        if int8 and not (wants_prepack and self.dtype == torch.bfloat16 and self.device.type == "cpu"):
            raise ValueError("--quantize int8 needs the CPU, bfloat16, one rank, weight prepacking on and inductor "
                             "freezing off (its int8 copies live beside the prepacked weights)")
        self.prepacked = prepack(model, compile_settings.quantize) \
            if wants_prepack and prepack_supported(self.dtype, self.device) else 0
        if self.prepacked:
            third = ""
            if int8:
                third = " and weight-only int8 for steps of 1-128 rows (a third copy, half the bytes of bf16)"
            elif self.dtype == torch.bfloat16 and native.amx_available():
                third = " and the AMX matmul (a third)"
            log.info("%d linear weights prepacked for oneDNN (a second copy of each)%s", self.prepacked, third)
        # Gated SiLU MLPs as one op: prompt-sized steps fuse silu and the product into oneDNN (models/gated_mlp.py).
        # Not in float32: its fused epilogues would apply swish where the reference rounds first.
        self.fused_mlps = fuse_gated_mlps(model) if self.prepacked and self.dtype != torch.float32 else 0
        # bf16 RMSNorms of prompt-sized steps in one C call (models/rms_norm.py); decode steps keep inductor's.
        self.native_norms = swap_rms_norms(model) \
            if self.prepacked and self.dtype == torch.bfloat16 and native.available() else 0
        self.storage = SlotStorage(
            model.config,
            max_slots=table.batch_sizes[-1],
            context_length=table.context_length,
            max_prefill_rows=table.prefill_batch_sizes[-1],
            max_prefill_length=table.lengths[-1],
            dtype=self.dtype,
            device=self.device,
            tp_size=tp_size,  # the cache holds this rank's local KV heads
            max_mixed_tokens=table.mixed_tokens[-1] if table.mixed_tokens else 0,
        )
        if table.mixed_tokens and (any(kind != "full_attention" for kind in self.storage.layer_types)
                                   or self.device.type != "cpu" or tp_size > 1):
            # Their attention op runs on the CPU, without sliding windows; under TP no plan carries them.
            raise ValueError("mixed steps need full-attention layers, the CPU and one rank")
        self.keys = list(table.graph_keys())
        self._known = {(k.phase, k.batch, k.length): k for k in self.keys}
        self.warmed: set[tuple[str, int, int]] = set()
        self.calls: collections.Counter[Any] = collections.Counter()  # graph key -> calls while serving
        self.is_serving = False
        self._decode_caches = {
            (b, kv): self.storage.decode_cache(b, kv) for b in table.batch_sizes for kv in table.kv_lengths
        }
        self._prefill_caches = {
            (p, n): self.storage.prefill_cache(p, n) for p in table.prefill_batch_sizes for n in table.lengths
        }
        self._chunk_caches = {kv: self.storage.chunk_cache(kv) for kv in table.chunk_kv_lengths}
        self._mixed_caches = {t: self.storage.mixed_cache(t) for t in table.mixed_tokens}
        self.sample_inputs = {rows: SampleInputs.allocate(rows, self.device) for rows in table.sample_batch_sizes}
        self.vocab_size = _vocab_size(model)
        kinds, window = self.storage.layer_types, sliding_window(model.config)
        decode = _make_decode_step(self.dtype, kinds, window)
        chunk = _make_chunk_step(self.dtype, kinds, window)
        # Inductor without freezing: one ahead-of-time compiled function per graph key, saved as a file in the
        # compile cache and loaded on the next start (frozen graphs embed their weights and cannot be saved).
        # Calls go straight to the key's function: no dynamo guard evaluation per step.
        self.aot = compile_settings.backend == "inductor" and not compile_settings.inductor_freezing
        if self.aot and not aot_available():
            log.warning("torch %s has no ahead-of-time compile: graphs compile in this process and are not "
                        "saved (torch 2.13 saves them)", torch.__version__)
            self.aot = False
        self.store = GraphStore(os.path.join(compile_settings.cache_dir, "graphs")) \
            if self.aot and compile_settings.cache_dir else None
        self._graphs: dict[Any, Callable[..., Any]] = {}
        self._built_elsewhere: dict[str, float] = {}  # label -> compile seconds in a builder process
        self._loaded: set[Any] = set()  # keys whose graph came from a saved artifact
        self._warming = False
        # Under tensor parallelism every rank must run every graph in step (its collectives pair up across
        # ranks, and another rank may be compiling, hence running, that graph): no skipped runs there.
        self._in_mesh = tp_size > 1
        self.fingerprint = model_fingerprint(model) if self.store is not None else ""
        if compile_settings.compiles and self.aot:
            configure_compiler(compile_settings, len(self.keys))
            self._inductor = resolve_backend("inductor")
            self._prefill_fn, self._decode_fn, self._chunk_fn = _prefill_step, decode, chunk
            self._sample_fn: Callable[..., Any] = _sample_step
            self._mixed_fn: Callable[..., Any] = _mixed_step
        elif compile_settings.compiles:
            configure_compiler(compile_settings, len(self.keys))
            if compile_settings.backend == "neuron" and compile_settings.cache_dir:
                self.accountant.probe_dir = compile_settings.cache_dir  # NEFFs land there on a miss
            self.accountant.cache_enabled = bool(compile_settings.cache_dir)
            backend = self.accountant.wrap(resolve_backend(compile_settings.backend))
            suffix = str(next(_runner_ids))
            self._prefill_fn = compile_step(_fresh_copy(_prefill_step, suffix), backend)
            self._decode_fn = compile_step(_fresh_copy(decode, suffix), backend)
            self._chunk_fn = compile_step(_fresh_copy(chunk, suffix), backend)
            self._sample_fn = compile_step(_fresh_copy(_sample_step, suffix), backend)
            self._mixed_fn = compile_step(_fresh_copy(_mixed_step, suffix), backend)
        else:
            self._prefill_fn, self._decode_fn, self._chunk_fn = _prefill_step, decode, chunk
            self._sample_fn, self._mixed_fn = _sample_step, _mixed_step

    @property
    def num_graphs(self) -> int:
        return len(self.keys)

    # -- warm-up -------------------------------------------------------------------------------------
    def warmup(
        self,
        keys: Iterable[Any] | None = None,
        progress: Callable[[Any, float, int, int], None] | None = None,
        builder: GraphBuilder | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> float:
        """Compile (or load) and run every graph once, in the table's fixed order; then forbid recompiles.
        With a builder, graphs missing from the store are split between this process and the builder's
        workers; this process warms its share first, then loads the others' artifacts. `cancelled` is asked
        before each graph: a shutdown during a cold start waits for one compile, not for the whole table."""
        todo = list(self.keys if keys is None else keys)
        start = time.perf_counter()
        self.accountant.phase = "warmup"
        todo, pending = self._share_out(todo, builder)
        self._warming = True
        try:
            self._warm_each(todo, pending, progress, cancelled)
        finally:
            self._warming = False
        self.start_serving()
        return time.perf_counter() - start

    def _warm_each(self, todo: list[Any], pending: tuple[set[Any], list[Future[dict[str, float]]]] | None,
                   progress: Callable[[Any, float, int, int], None] | None,
                   cancelled: Callable[[], bool] | None) -> None:
        for done, key in enumerate(todo, 1):
            if cancelled is not None and cancelled():
                raise WarmupCancelled(f"warm-up cancelled after {done - 1} of {len(todo)} graphs")
            if pending and key in pending[0]:
                self._collect(pending)
            t0 = time.perf_counter()
            if key.phase == "decode":
                zeros = torch.zeros(key.batch, dtype=torch.long)
                self._run_decode(key.batch, key.length, zeros, zeros)
            elif key.phase == "sample":
                self._run_sample(torch.zeros(key.batch, self.vocab_size, dtype=self.dtype, device=self.device))
            elif key.phase == "chunk":
                # Slot 0 from position c: what the warm-up's dummy writes there, no request reads.
                self._run_chunk(key.length, 0, self.table.chunk_length, [0])
            elif key.phase == "mixed":
                self._run_mixed(key.length, [0], [0], [0], [0])
            else:
                self._run_prefill(key.batch, key.length, [PrefillRow(0, [0])] * key.batch, commit=False)
            self.warmed.add((key.phase, key.batch, key.length))
            if progress is not None:
                progress(key, time.perf_counter() - t0, done, len(todo))

    def _share_out(self, todo: list[Any], builder: GraphBuilder | None
                   ) -> tuple[list[Any], tuple[set[Any], list[Future[dict[str, float]]]] | None]:
        if builder is None or builder.workers < 1 or self.store is None:
            return todo, None
        store = self.store
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

    def _collect(self, pending: tuple[set[Any], list[Future[dict[str, float]]]]) -> None:
        """Wait for the builders; a builder that failed only means this process compiles those graphs."""
        keys, futures = pending
        for future in futures:
            try:
                self._built_elsewhere.update(future.result())
            except Exception as exc:  # noqa: BLE001  the graphs are compiled here instead
                log.error("a graph builder process failed (%s: %s); compiling its graphs here",
                          type(exc).__name__, exc)
        futures.clear()
        keys.clear()

    def start_serving(self) -> None:
        """From now on every compilation counts as a recompile; with policy 'error' it is refused."""
        self.accountant.phase = "serving"
        self.is_serving = True

    def stop_serving(self) -> None:
        self.is_serving = False

    @property
    def _fail_closed(self) -> bool:
        return self.is_serving and self.settings.compiles and self.settings.recompile_policy == "error"

    # -- steps ---------------------------------------------------------------------------------------
    def prefill(self, rows: list[PrefillRow], length: int, batch: int) -> torch.Tensor:
        """Prefill `rows` (<= batch, each <= length tokens) into their slots; logits [len(rows), V]."""
        return self._run_prefill(batch, length, rows, commit=True)[: len(rows)]

    def decode(self, batch: int, tokens: torch.Tensor, positions: torch.Tensor, kv: int | None = None) -> torch.Tensor:
        """tokens, positions: [batch] host tensors (row i = slot i; free slots carry token 0 at position 0).
        `kv`: the KV-length bucket (None: the smallest covering max(positions) + 1). Returns logits [batch, V]."""
        if kv is None:
            kv = self.table.kv_for(int(positions.max()) + 1)
        return self._run_decode(batch, kv, tokens, positions)

    def chunk(self, slot: int, offset: int, token_ids: list[int], kv: int) -> torch.Tensor:
        """Prefill tokens [offset, offset + len(token_ids)) of the prompt in `slot` (whose earlier positions
        are already cached), padded to the chunk length, attending over the slot's first `kv` positions.
        Returns logits [1, V] at the last given token."""
        return self._run_chunk(kv, slot, offset, token_ids)

    def mixed(self, tokens: int, ids: list[int], positions: list[int], slots: list[int], keep: list[int]
              ) -> torch.Tensor:
        """A mixed step of token bucket `tokens`: token t (t < len(ids) <= tokens) is ids[t] at positions[t] of
        slot slots[t] (decoding rows one token each, prompt pieces at consecutive positions of their slot; each
        token attends over its slot's positions up to its own). Returns logits [max batch, V]: row r is the
        token keep[r] (r < len(keep)), the other rows are padding."""
        return self._run_mixed(tokens, ids, positions, slots, keep)

    def sample(self, logits: torch.Tensor, rows: Sequence[tuple[float, int, float, float, int, int] | None]
               ) -> tuple[torch.Tensor, ...]:
        """logits: [R, V] as a step returned them (R a row bucket); rows: (temperature, top_k, top_p, min_p, seed,
        position) per row (None: greedy). Returns (ids [R], logprob [R], top ids [R, 20], top logprobs
        [R, 20], exact_on_host [R]) from the sampling graph of R rows, still on the device."""
        self.sample_inputs[logits.shape[0]].fill(rows)
        # The sampling graph is compiled for contiguous rows, but a step's logits may come with padded rows:
        # inductor on CUDA pads bf16 rows to 16 bytes (a vocabulary of 420 gives a row stride of 424). A
        # stride is part of the shape: unpadded here, where it is padded at all. Strides, not is_contiguous():
        # a single padded row counts as contiguous, and .contiguous() keeps its stride.
        if logits.stride() != (logits.shape[1], 1):
            logits = logits.clone(memory_format=torch.contiguous_format)
        return self._run_sample(logits)

    def _run_sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = logits.shape[0]
        key = self._check("sample", rows, 0)
        return self._call(self._sample_fn, key, logits, self.sample_inputs[rows])  # type: ignore[return-value]

    def _check(self, phase: str, batch: int, length: int) -> Any:
        key = self._known.get((phase, batch, length))
        if key is None:
            raise UnknownShapeError(f"{phase} graph for batch {batch}, length {length} is not in the bucket table")
        if self._fail_closed and (phase, batch, length) not in self.warmed:
            self.accountant.refused(key, "unwarmed_shape")
            raise RecompileError(f"graph {key} was not warmed up; refusing to compile while serving")
        self.accountant.current_key = key
        if self.is_serving:
            self.calls[key] += 1
        return key

    def _call(self, fn: Callable[..., torch.Tensor], key: Any, *args: Any) -> torch.Tensor:
        if self.aot:
            with torch.no_grad():
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._prepare(fn, key, args)
                    if self._warming and key in self._loaded and not self._in_mesh:
                        # A sound saved graph: checked against these very inputs (its guards), not run; a
                        # restart's warm-up is then only loading (2-3 s of runs saved on the default table).
                        return torch.empty(0)
                return graph(self.model, *args)  # type: ignore[no-any-return]
        # The stance is scoped to this runner's calls (it is process-wide state, and tests run several).
        stance = fail_on_recompile() if self._fail_closed else contextlib.nullcontext()
        try:
            with torch.no_grad(), stance:  # grad mode is thread-local and guarded on: always the same
                return fn(self.model, *args)
        except RuntimeError as exc:
            if "fail_on_recompile" in str(exc) or "Detected recompile" in str(exc):
                self.accountant.refused(key, "guard_failure")
                raise RecompileError(f"graph {key} would recompile after warm-up: {exc}") from exc
            raise

    def _prepare(self, fn: Callable[..., Any], key: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The key's compiled function: loaded from the store when its artifact is sound and fits this model
        and cache (its guards pass on these inputs), else compiled now and saved."""
        if self._fail_closed:  # _check refuses unwarmed keys first; never compile while serving fail-closed
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
            built = self._built_elsewhere.pop(label_of(key), None)
            # Built by a builder process during this warm-up: a cold compile (a miss), timed there.
            self.accountant.record(loaded.seconds if built is None else built, cache_hit=built is None)
            self._loaded.add(key)
            return loaded.fn
        if reason != "missing":
            self.accountant.rejected(key, reason)
            self.store.remove(key)
        return None

    def _run_decode(self, batch: int, kv: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key = self._check("decode", batch, kv)
        ids = tokens.view(batch, 1).to(self.device)
        pos = positions.to(self.device)
        return self._call(self._decode_fn, key, self._decode_caches[(batch, kv)], ids, pos)

    def _run_prefill(self, batch: int, length: int, rows: list[PrefillRow], *, commit: bool) -> torch.Tensor:
        key = self._check("prefill", batch, length)
        if not 0 < len(rows) <= batch:
            raise ValueError(f"{len(rows)} rows do not fit prefill batch {batch}")
        ids = torch.zeros(batch, length, dtype=torch.long)
        last = torch.zeros(batch, 1, dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            if not 0 < n <= length:
                raise ValueError(f"a prompt of {n} tokens does not fit length bucket {length}")
            ids[i, :n] = torch.tensor(row.token_ids, dtype=torch.long)
            last[i, 0] = n - 1
        cache = self._prefill_caches[(batch, length)]
        logits = self._call(self._prefill_fn, key, cache, ids.to(self.device), last.to(self.device))
        if commit:
            self.storage.commit(cache, [r.slot for r in rows], [len(r.token_ids) for r in rows])
        return logits

    def _run_mixed(self, tokens: int, ids: list[int], positions: list[int], slots: list[int], keep: list[int]
                   ) -> torch.Tensor:
        rows = self.table.batch_sizes[-1]
        key = self._check("mixed", rows, tokens)
        n = len(ids)
        if not 0 < n <= tokens or len(positions) != n or len(slots) != n or len(keep) > rows:
            raise ValueError(f"a mixed step of {n} tokens and {len(keep)} logit rows does not fit {tokens} tokens, "
                             f"{rows} rows")
        if any(not 0 <= p < self.table.context_length for p in positions) or any(
                not 0 <= s < self.storage.spare_slot for s in slots) or any(not 0 <= k < n for k in keep):
            raise ValueError("a mixed step's position, slot or logit row is out of range")
        pad = tokens - n
        # [T] pad tokens: token 0 at position 0 of the spare slot (written there, never read).
        ids_t = torch.tensor(ids + [0] * pad, dtype=torch.long).view(1, tokens)
        pos_t = torch.tensor(positions + [0] * pad, dtype=torch.long)
        meta = torch.stack([torch.tensor(slots + [self.storage.spare_slot] * pad, dtype=torch.long), pos_t], 1)
        keep_t = torch.tensor(keep + [0] * (rows - len(keep)), dtype=torch.long)
        dev = self.device
        return self._call(self._mixed_fn, key, self._mixed_caches[tokens], ids_t.to(dev), pos_t.view(1, tokens).to(dev),
                          meta.to(dev), keep_t.to(dev))

    def _run_chunk(self, kv: int, slot: int, offset: int, token_ids: list[int]) -> torch.Tensor:
        key = self._check("chunk", 1, kv)
        c = self.table.chunk_length
        n = len(token_ids)
        if not 0 < n <= c or offset % c or offset + c > self.table.context_length or offset + n > kv:
            raise ValueError(f"a chunk of {n} tokens at offset {offset} does not fit chunk length {c} and KV {kv}")
        ids = torch.zeros(1, c, dtype=torch.long)
        ids[0, :n] = torch.tensor(token_ids, dtype=torch.long)
        dev = self.device
        args = (ids.to(dev), torch.tensor([slot], device=dev), torch.tensor([offset], device=dev),
                torch.tensor([[n - 1]], device=dev))
        return self._call(self._chunk_fn, key, self._chunk_caches[kv], *args)
