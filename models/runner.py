"""The model runner: owns the model, the slot cache and one compiled graph per bucket.

All calls come from one thread (the engine thread). Shapes come from the bucket table the server passes in
(duck-typed here, models/shape_table.py: `models` does not import `buckets`); a shape outside it is refused, never
compiled. What a graph computes is in models/step_functions.py, how graphs are compiled, saved and called in
models/graph_set.py; this module fills each step's inputs, picks its cache and keeps the warm-up's order.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from models.compile import CompileAccountant, CompileSettings, RecompileError
from models.graph_builder import GraphBuilder, share_out
from models.graph_set import GraphSet
from models.masks import sliding_window
from models.module_swaps import swap_modules
from models.rotary_table import tabulate_rotary
from models.sample_graph import SampleInputs
from models.shape_table import ShapeTable, UnknownShapeError
from models.slot_cache import SlotStorage
from models.step_functions import (
    PrefillRow,
    make_chunk_step,
    make_decode_step,
    make_mixed_step,
    prefill_step,
    sample_step,
    vocab_size,
    zeroes_free_rows,
)
from models.warmup import WarmupCancelled, warm_each

__all__ = ["ModelRunner", "PrefillRow", "ShapeTable", "UnknownShapeError", "WarmupCancelled"]


class ModelRunner:
    """The model, its slot cache and its graphs: warm-up, then one graph call a step (prefill, decode, chunk,
    mixed, sample), refusing any shape outside the table."""

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
        # Rotary cos/sin looked up by position, not recomputed in every layer of every step (models/rotary_table.py).
        self.rotary_tables = tabulate_rotary(model, table.context_length, self.dtype)
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
        # After the cache: the weights' extra copies are made only where memory is left for them.
        swaps = swap_modules(model, compile_settings, tp_size)
        self.prepacked, self.fused_mlps, self.native_norms = swaps.prepacked, swaps.fused_mlps, swaps.native_norms
        self.fused_layers = swaps.fused_layers
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
        self._mixed_caches = {t: self.storage.mixed_cache(t) for t in {*table.mixed_tokens, *table.verify_tokens}}
        self.sample_inputs = {rows: SampleInputs.allocate(rows, self.device) for rows in table.sample_batch_sizes}
        self.vocab_size = vocab_size(model)
        kinds, window = self.storage.layer_types, sliding_window(model.config)
        zero = zeroes_free_rows(model.config)
        fns: dict[str, Callable[..., Any]] = {
            "prefill": prefill_step, "decode": make_decode_step(self.dtype, kinds, window, zero),
            "chunk": make_chunk_step(self.dtype, kinds, window), "mixed": make_mixed_step(zero, swaps.kept_rows),
            "verify": make_mixed_step(zero, swaps.kept_rows), "sample": sample_step,
        }
        self.graphs = GraphSet(model, compile_settings, self.accountant, len(self.keys), fns)
        self._warming = False
        # Under tensor parallelism every rank must run every graph in step (its collectives pair up across
        # ranks, and another rank may be compiling, hence running, that graph): no skipped runs there.
        self._in_mesh = tp_size > 1

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
        todo, pending = share_out(todo, builder, self.graphs.store)
        self._warming = True
        try:
            warm_each(self, todo, pending, progress, cancelled)
        finally:
            self._warming = False
        self.start_serving()
        return time.perf_counter() - start

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
        """tokens, positions: [batch] host tensors (row i = slot i; a free slot carries token 0 at position -1:
        its row is zeroed and computes nothing).
        `kv`: the KV-length bucket (None: the smallest covering max(positions) + 1). Returns logits [batch, V]."""
        if kv is None:
            kv = self.table.kv_for(max(1, int(positions.max()) + 1))  # every row free: the smallest
        return self._run_decode(batch, kv, tokens, positions)

    def chunk(self, slot: int, offset: int, token_ids: list[int], kv: int) -> torch.Tensor:
        """Prefill tokens [offset, offset + len(token_ids)) of the prompt in `slot` (whose earlier positions
        are already cached), padded to the chunk length, attending over the slot's first `kv` positions.
        Returns logits [1, V] at the last given token."""
        return self._run_chunk(kv, slot, offset, token_ids)

    def mixed(self, tokens: int, ids: list[int], positions: list[int], slots: list[int], keep: list[int],
              rows: int = 0) -> torch.Tensor:
        """A mixed step of token bucket `tokens`: token t (t < len(ids) <= tokens) is ids[t] at positions[t] of
        slot slots[t] (decoding rows one token or more each, prompt pieces at consecutive positions of their slot;
        each token attends over its slot's positions up to its own). `rows`: the graph's logit rows (0: the max
        batch; the table's verify_rows: a verify graph). Returns logits [rows, V]: row r is the token keep[r]
        (r < len(keep)); the other rows are padding, and keep[r] < 0 marks one inside `keep` too."""
        return self._run_mixed(tokens, ids, positions, slots, keep, rows or self.table.batch_sizes[-1])

    def copy_prefix(self, source: int, target: int, n: int) -> None:
        """Prefix caching: K/V positions [0, n) of slot `source` into slot `target`, before a step that reads them."""
        self.storage.copy_prefix(source, target, n)

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
        out: tuple[torch.Tensor, ...] = self.graphs.call(key, (logits, self.sample_inputs[rows]),
                                                         fail_closed=self._fail_closed, skip_loaded=self._skip_loaded)
        return out

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

    def _call(self, key: Any, *args: Any) -> torch.Tensor:
        """Logits [rows, V] of the key's graph on these inputs."""
        out: torch.Tensor = self.graphs.call(key, args, fail_closed=self._fail_closed, skip_loaded=self._skip_loaded)
        return out

    @property
    def _skip_loaded(self) -> bool:
        """Warm-up on one rank: a graph loaded from a sound artifact need not run (GraphSet.call)."""
        return self._warming and not self._in_mesh

    def _run_decode(self, batch: int, kv: int, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key = self._check("decode", batch, kv)
        ids = tokens.view(batch, 1).to(self.device)
        pos = positions.to(self.device)
        return self._call(key, self._decode_caches[(batch, kv)], ids, pos)

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
        logits = self._call(key, cache, ids.to(self.device), last.to(self.device))
        if commit:
            self.storage.commit(cache, [r.slot for r in rows], [len(r.token_ids) for r in rows])
        return logits

    def _run_mixed(self, tokens: int, ids: list[int], positions: list[int], slots: list[int], keep: list[int],
                   rows: int) -> torch.Tensor:
        key = self._check("mixed" if rows == self.table.batch_sizes[-1] else "verify", rows, tokens)
        n = len(ids)
        if not 0 < n <= tokens or len(positions) != n or len(slots) != n or len(keep) > rows:
            raise ValueError(f"a mixed step of {n} tokens and {len(keep)} logit rows does not fit {tokens} tokens, "
                             f"{rows} rows")
        if any(not 0 <= p < self.table.context_length for p in positions) or any(
                not 0 <= s < self.storage.spare_slot for s in slots) or any(not -1 <= k < n for k in keep):
            raise ValueError("a mixed step's position, slot or logit row is out of range")
        pad = tokens - n
        # A padding logit row reads a padding token where the step has one: its hidden state is zero, and the
        # CPU kernels skip zero rows of the lm_head's matmul (a verify graph has up to verify_rows of them).
        blank = n if pad else 0
        keep = [k if k >= 0 else blank for k in keep]
        # [T] pad tokens: token 0 at position 0 of the spare slot (written there, never read); to the model
        # they come at position -1: their rows are zeroed, and kernels that skip zero rows skip them.
        ids_t = torch.tensor(ids + [0] * pad, dtype=torch.long).view(1, tokens)
        meta = torch.tensor([[s, p] for s, p in zip(slots + [self.storage.spare_slot] * pad, positions + [0] * pad)],
                            dtype=torch.long)
        pos_t = torch.tensor(positions + [-1] * pad, dtype=torch.long)
        keep_t = torch.tensor(keep + [blank] * (rows - len(keep)), dtype=torch.long)
        dev = self.device
        return self._call(key, self._mixed_caches[tokens], ids_t.to(dev), pos_t.view(1, tokens).to(dev),
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
        return self._call(key, self._chunk_caches[kv], *args)
