"""What the engine thread drives: weights, runner, warm-up and one step of the scheduler's plan.

Built on the event loop's side cheaply (tokenizer, config, bucket table); the heavy part (weights, cache,
compilation) runs in `load_and_warm`, on the engine thread, so the HTTP port is open during warm-up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from buckets import BucketTable, GraphKey
from buckets.scheduler import ChunkStep, MixedStep, PrefillStep, Sequence, Step
from models.cache_layout import full_attention_only
from models.compile import CompileAccountant, CompileRecord, CompileSettings, cache_key, prewarm_inductor
from models.graph_builder import BuildSpec, ProcessBuilder, builders_that_fit
from models.greedy_head import maxima_only
from models.hardware import resolve_compile_workers, resolve_dtype, resolve_num_threads
from models.loading import cache_root, eos_token_ids, load_model, load_tokenizer, max_positions, model_display_name
from models.mesh import MeshSpec
from models.runner import ModelRunner, PrefillRow
from models.sampling import SampledToken, Sampler, SamplingParams
from models.step_plan import rank_runner
from server.config import DEFAULT_MAX_MODEL_LEN, ServerSettings, check_device
from server.engine.mesh import EngineMesh
from server.engine.mixed_inputs import mixed_inputs
from server.engine.step_sampling import StepLogits, sample_step
from server.engine.warmup_counter import WarmupCounter
from server.metrics.hooks import MetricsHooks
from server.metrics.safe_hooks import SafeHooks

log = logging.getLogger("bucketserve.warmup")


class CacheMissingError(RuntimeError):
    """--require-cached-graphs: a graph was compiled instead of loaded from the compile cache."""


class EngineModel:
    def __init__(self, settings: ServerSettings, model_path: str, metrics: MetricsHooks | None = None,
                 table: BucketTable | None = None, mesh_spec: MeshSpec | None = None) -> None:
        from transformers import AutoConfig

        self.settings = settings
        self.path = model_path
        check_device(settings.device)
        # "auto" settings resolved once, here: everything after (loading, cache key, info) uses these.
        self.dtype = resolve_dtype(settings.dtype, settings.device)
        self.num_threads = resolve_num_threads(settings.num_threads)
        self.metrics = SafeHooks(metrics)
        self.tokenizer: Any = load_tokenizer(model_path)
        self.config = AutoConfig.from_pretrained(model_path)
        settings.check_quantize()
        settings.check_cuda_graphs()
        # Mixed steps' attention op has no sliding windows: such models keep separate prefill and decode steps.
        limit = max_positions(self.config)
        self.table = table or settings.bucket_table(limit, mixed_ok=full_attention_only(self.config))
        if settings.max_model_len > max(limit, DEFAULT_MAX_MODEL_LEN):  # the default is capped without a word
            log.warning("--max-model-len %d is above the model's %d positions: each sequence gets %d",
                        settings.max_model_len, limit, self.table.context_length)
        self.name = settings.served_model_name or model_display_name(model_path)
        self.eos_token_ids = eos_token_ids(self.config, self.tokenizer)
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        # Rows of the embedding table (an id past it would fail the whole step it is batched into), and no
        # more than the tokenizer can decode: the one limit on client token ids, HTTP and engine alike.
        self.vocab_limit = min(int(getattr(text_config, "vocab_size", 0) or len(self.tokenizer)), len(self.tokenizer))
        self.progress = WarmupCounter(self.table.num_graphs)
        self.runner: ModelRunner | None = None
        self._decode_tokens = torch.zeros(self.table.max_batch, dtype=torch.long)  # host input buffers
        self._decode_positions = torch.zeros(self.table.max_batch, dtype=torch.long)
        self.accountant = CompileAccountant(on_compile=self._on_compile, on_refused=self._on_refused,
                                            on_rejected=self._on_rejected)
        self._ready = threading.Event()
        self.mesh_spec = mesh_spec
        self.mesh = EngineMesh(mesh_spec) if mesh_spec is not None else None  # tensor parallel
        self._cancel = threading.Event()  # set by the engine's stop: a warm-up in progress ends early
        self._builder: ProcessBuilder | None = None

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set()

    def sampler(self, params: SamplingParams, prompt_ids: list[int]) -> Sampler:
        return Sampler(params, prompt_ids)

    # -- engine thread ---------------------------------------------------------------------------------
    def load_and_warm(self, keys: list[GraphKey] | None = None) -> None:
        """Load weights and warm `keys` (default: every graph of the table)."""
        s = self.settings
        torch.set_num_threads(self.num_threads)
        prewarm = prewarm_inductor(self.compile_cache_dir()) if s.compile_backend == "inductor" else None
        compile_settings = CompileSettings(s.compile_backend, s.recompile_policy, self.compile_cache_dir(),
                                           s.inductor_freezing, s.weight_prepack, s.native_kernels,
                                           quantize=s.quantize, cuda_graphs=s.cuda_graphs)
        self.runner = self.build_runner(compile_settings, prewarm)
        log.info("bucket table: lengths %s, batch sizes %s, prefill batch sizes %s, KV lengths %s, mixed tokens "
                 "%s, context %d: %d graphs", list(self.table.lengths), list(self.table.batch_sizes),
                 list(self.table.prefill_batch_sizes), list(self.table.kv_lengths), list(self.table.mixed_tokens),
                 self.table.context_length, self.runner.num_graphs)
        store = self.runner.graphs.store
        if s.require_cached_graphs and store is not None:
            # Fail before compiling anything: every graph must have its saved artifact.
            missing = [str(k) for k in (keys or self.runner.keys) if not store.has(k)]
            if missing:
                raise CacheMissingError(f"{len(missing)} graphs were not in the compile cache: {', '.join(missing)}")
        self.metrics.warmup_progress(0, self.table.num_graphs)
        self.progress.started = time.monotonic()
        if keys is not None:
            self.progress.total = len(keys)
        # Builders only help a cold start of saved graphs (inductor without freezing, with a cache directory);
        # a tensor-parallel rank's graphs need the mesh: none; and each builder needs about this process's memory.
        wanted = resolve_compile_workers(s.compile_workers) - 1 if store is not None and self.mesh is None else 0
        builders = builders_that_fit(wanted)
        spec = BuildSpec(self.path, self.dtype, s.device, self.table, compile_settings, self.num_threads)
        with ProcessBuilder(spec, builders) as builder:
            self._builder = builder
            seconds = self.runner.warmup(keys, progress=self._on_warm, builder=builder,
                                         cancelled=self._cancel.is_set)
        self.progress.finished = time.monotonic()
        hits = sum(1 for r in self.accountant.records if r.cache_hit)
        log.info("warm-up done: %d graphs in %.1f s, %d compiled, %d loaded from the compile cache",
                 self.progress.done, seconds, self.accountant.count() - hits, hits)
        if compile_settings.cache_dir:
            log.info("compile cache %s: %d of %d graphs loaded from the cache", compile_settings.cache_dir, hits,
                     len(self.accountant.records))
        if s.require_cached_graphs:
            missing = [str(r.key) for r in self.accountant.records if not r.cache_hit]
            if missing:
                raise CacheMissingError(f"{len(missing)} graphs were not in the compile cache: {', '.join(missing)}")
        if self.mesh is not None:
            self.mesh.warmed(self.runner, self.metrics)
        self.metrics.warmup_finished(seconds)
        self.metrics.set_ready(True)
        self._ready.set()

    def build_runner(self, compile_settings: CompileSettings | None = None, prewarm: Any = None) -> ModelRunner:
        """Load the weights (under tensor parallelism: join the mesh, load this rank's shard) and the runner."""
        s = self.settings
        if compile_settings is None:
            compile_settings = CompileSettings(s.compile_backend, s.recompile_policy, self.compile_cache_dir(),
                                               s.inductor_freezing, s.weight_prepack, s.native_kernels,
                                               quantize=s.quantize, cuda_graphs=s.cuda_graphs)
        torch.set_num_threads(self.num_threads)
        t0 = time.monotonic()
        model = self.mesh.load(self.path, self.dtype) if self.mesh else load_model(self.path, self.dtype, s.device)
        if prewarm is not None:
            prewarm.join()
        log.info("loaded %s (%s, %s, %d compute threads%s) in %.1f s", self.name, self.dtype, s.device,
                 self.num_threads, self.mesh.note if self.mesh else "", time.monotonic() - t0)
        return rank_runner(model, self.table, compile_settings, self.accountant, self.mesh.mesh if self.mesh else None)

    def tick(self) -> None:
        """Engine thread, between steps: under tensor parallelism an idle rank 0 heartbeats the followers."""
        if self.mesh is not None and self.is_ready:
            self.mesh.tick(self.runner, self.metrics)

    def mesh_info(self) -> dict[str, Any] | None:
        """The mesh for /ready: layout and each rank's compilations (None without a mesh)."""
        return self.mesh.info() if self.mesh is not None else None

    def compile_cache_dir(self) -> str:
        """The keyed subdirectory of --compile-cache-dir for this model, dtype, device, buckets and versions."""
        root = self.settings.compile_cache_dir
        if root in ("", "none"):
            return ""
        if root == "auto":
            root = str(cache_root() / "compile")
        local = os.path.isdir(self.path)
        weights = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                         for p in Path(self.path).glob("*.safetensors")) if local else []
        parts = {"model": os.path.abspath(self.path) if local else self.path, "weights": weights,
                 "dtype": self.dtype, "device": self.settings.device,
                 "backend": self.settings.compile_backend, "freezing": self.settings.inductor_freezing,
                 "weight_prepack": self.settings.weight_prepack,
                 "buckets": self.table.to_dict(), "threads": self.num_threads}
        if self.mesh_spec is not None:  # each rank compiles graphs over its own shard
            parts["tensor_parallel"] = [self.mesh_spec.tp_size, self.mesh_spec.rank]
        return os.path.join(root, cache_key(parts))

    def run_step(self, step: Step, prompt_of: Callable[[str], list[int]], maxima: bool = False) -> StepLogits:
        """Runs the graph for one scheduler step. The logits stay where the graph left them (the sampling
        step reads them there); `rows` says which row belongs to each of step.sampling_seqs. `maxima`: the step's
        tokens are each row's maximum and nothing else reads its logits (every sampling row greedy, without
        logprobs or penalties), so a float32 head may give each row its maximum alone (models/greedy_head.py)."""
        with maxima_only(maxima):
            return self._run_step(step, prompt_of)

    def _run_step(self, step: Step, prompt_of: Callable[[str], list[int]]) -> StepLogits:
        assert self.runner is not None
        t0 = time.perf_counter()
        if isinstance(step, PrefillStep):
            # A chunked prompt's first chunk is its first `length` tokens.
            rows = [PrefillRow(seq.slot, prompt_of(seq.request_id)[: step.length]) for seq in step.seqs]
            logits = self.runner.prefill(rows, step.length, step.batch)
            ends = [i for i, seq in enumerate(step.seqs) if seq.prompt_len <= step.length]
            key = GraphKey("prefill", step.batch, step.length)
            self.metrics.prefill_done(key, len(rows), step.padding_tokens, time.perf_counter() - t0)
            return StepLogits(logits, ends)
        if isinstance(step, ChunkStep):
            seq = step.seq
            part = prompt_of(seq.request_id)[step.offset : step.offset + step.num_tokens]
            logits = self.runner.chunk(seq.slot, step.offset, part, step.kv)
            self.metrics.chunk_done(GraphKey("chunk", 1, step.kv), step.padding_tokens, time.perf_counter() - t0)
            return StepLogits(logits, [0] if step.is_final else [])
        if isinstance(step, MixedStep):
            return self._run_mixed(step, prompt_of, t0)
        # Row i of a decode batch is slot i; free slots run as dummies (token 0 at position -1: the graph zeroes
        # them and the CPU kernels skip zero rows). The inputs are written in place into preallocated host
        # buffers (through their numpy views: no tensor per step).
        b = step.batch
        tokens, positions = self._decode_tokens.numpy(), self._decode_positions.numpy()
        tokens[:b] = 0
        positions[:b] = -1
        slots = [seq.slot for seq in step.seqs]
        tokens[slots] = [seq.last_token for seq in step.seqs]
        positions[slots] = [seq.position for seq in step.seqs]
        for slot, position in step.parked:  # a slot mid-chunking: its dummy write lands where its next chunk writes
            positions[slot] = position
        logits = self.runner.decode(b, self._decode_tokens[:b], self._decode_positions[:b], step.kv)
        self.metrics.decode_step_done(step.batch, len(step.seqs), time.perf_counter() - t0, step.padding_rows)
        return StepLogits(logits, slots)

    def _run_mixed(self, step: MixedStep, prompt_of: Callable[[str], list[int]], t0: float) -> StepLogits:
        """Decoding rows first (one token each, slot order), then each prompt piece; logits row r belongs to
        step.sampling_seqs[r] (the decoding rows, then the pieces that end their prompt)."""
        assert self.runner is not None
        for source, target, n in step.copies:  # prefix caching: reused K/V, before the step reads it
            self.runner.copy_prefix(source, target, n)
        t = mixed_inputs(step, prompt_of, self.table)
        logits = self.runner.mixed(step.tokens, t.ids, t.positions, t.slots, t.keep, t.rows)
        self.metrics.mixed_done(GraphKey("verify" if step.drafts else "mixed", t.rows, step.tokens), len(step.decode),
                                step.padding_tokens, time.perf_counter() - t0)
        if step.drafts:  # [max batch, V] to sample from (the sampling graph's rows), [drafts, V] to verify
            b = self.table.max_batch
            return StepLogits(logits[:b], list(range(t.sampled)), logits[b : b + t.drafts])
        return StepLogits(logits, list(range(t.sampled)))

    def sample(self, seqs: tuple[Sequence, ...], samplers: list[Sampler | None], out: StepLogits
               ) -> list[SampledToken | Exception | None]:
        """One token per sampling row of a step (None for a request aborted meanwhile)."""
        assert self.runner is not None
        return sample_step(self.runner, seqs, samplers, out)

    def cancel_warmup(self) -> None:
        """From the stopping thread: the warm-up ends before its next graph, and builder processes now
        (the process could not exit while they run: Python joins its process pools at exit)."""
        self._cancel.set()
        builder = self._builder
        if builder is not None:
            builder.close(abandon=True)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.stop_serving()
        if self.mesh is not None:
            self.mesh.close(self.runner)

    # -- callbacks -------------------------------------------------------------------------------------
    def _on_warm(self, key: Any, seconds: float, done: int, total: int) -> None:
        self.progress.done = done
        record = self.accountant.records[-1] if self.accountant.records else None
        source = ""
        if record is not None and record.key == key:
            source = {True: " (from cache)", False: " (compiled)", None: " (compiled)"}[record.cache_hit]
            if record.cache_hit is False and record.seconds > seconds + 1.0:  # loaded here, compiled by a builder
                source = f" (compiled; {record.seconds:.1f} s in a builder process)"
        log.info("warm-up %d/%d %s %.2f s%s", done, total, key, seconds, source)
        # Against the whole table: a partial warm-up (tests, `generate`) must not look complete.
        self.metrics.warmup_progress(done, self.table.num_graphs)

    def _on_refused(self, key: Any, reason: str) -> None:
        self.metrics.recompiled(reason)

    def _on_rejected(self, key: Any, reason: str) -> None:
        self.metrics.artifact_rejected(reason.split(":")[0])

    def _on_compile(self, record: CompileRecord) -> None:
        if record.key is None:
            return
        rank = self.mesh_spec.rank if self.mesh_spec is not None else 0
        self.metrics.rank_compilations(rank, self.accountant.count("warmup"), self.accountant.count("serving"))
        self.metrics.graph_compiled(record.key, record.seconds, record.phase)
        if record.cache_hit is not None:
            self.metrics.compile_cache(record.cache_hit)
        if record.phase == "serving":
            assert self.runner is not None
            k = record.key
            warmed = (k.phase, k.batch, k.length) in self.runner.warmed
            self.metrics.recompiled("guard_failure" if warmed else "unwarmed_shape")

