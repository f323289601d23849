"""The CPU module swaps a runner makes before it compiles anything: prepacked linears, fused gated MLPs and native
RMSNorms (class swaps on the loaded model: same parameters, same module tree; each module's docstring says why).
Which apply depends on the device, dtype and settings: none on an accelerator or under tensor parallelism.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from models import native, native_matmul
from models.compile import CompileSettings
from models.fused_layer import FUSED_DTYPES, swap_fused_layers
from models.gated_mlp import fuse_gated_mlps
from models.hardware import MEMORY_RESERVE, available_memory
from models.kept_rows import swap_last_layer
from models.prepack import dispatch_natively, onednn_unread, packable_bytes, prepack
from models.prepack import supported as prepack_supported
from models.rms_norm import swap_rms_norms

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ModuleSwaps:
    """How many of each swap the model got (0: none)."""

    prepacked: int  # distinct linear weights with a packed copy (models/prepack.py)
    fused_mlps: int  # gated SiLU MLPs as one op (models/gated_mlp.py)
    native_norms: int  # RMSNorms of prompt-sized steps in one C call (models/rms_norm.py)
    kept_rows: bool = False  # the last layer's MLP on the rows whose logits a step keeps (models/kept_rows.py)
    fused_layers: int = 0  # decoder layers of mixed, verify and decode steps as two C++ ops (models/fused_layer.py)


def swap_modules(model: torch.nn.Module, settings: CompileSettings, tp_size: int) -> ModuleSwaps:
    """Make the swaps `settings` ask for and the model's device and dtype allow. Raises ValueError for
    --quantize int8 where its copies cannot live (not the CPU, bfloat16, one rank and prepacked linears)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    # Packed weights live outside the graphs (the graphs call bucketserve::linear with the plain weight);
    # freezing packs inside the graph instead, Neuron compiles its own matmuls, a TP shard is a DTensor.
    wants_prepack = settings.weight_prepack and not settings.inductor_freezing and settings.backend != "neuron" \
        and tp_size == 1
    native.configure(settings.native_kernels)
    if device.type == "cpu" and dtype in native.ATTENTION_DTYPES:
        native.available()  # build (once per machine) or load the kernels now, not in the first request's step
    int8 = settings.quantize == "int8"
    if int8 and not (wants_prepack and dtype == torch.bfloat16 and device.type == "cpu"):
        raise ValueError("--quantize int8 needs the CPU, bfloat16, one rank, weight prepacking on and inductor "
                         "freezing off (its int8 copies live beside the prepacked weights)")
    copies = _copies_that_fit(model) if wants_prepack and prepack_supported(dtype, device) else 0
    prepacked = prepack(model, settings.quantize, tiles=copies > 1) if copies else 0
    if prepacked:
        third = ""
        if int8:
            third = " and weight-only int8 for steps of 1-128 rows (a third copy, half the bytes of bf16)"
        elif copies < 2:
            third = "; no tile copies (memory is short): small steps take oneDNN or the plain weight"
        elif dtype == torch.bfloat16 and native_matmul.amx_available():
            third = " and the AMX and vector matmuls on a tile copy (a third)"
        elif dtype == torch.bfloat16 and native_matmul.tiled_available():
            third = " and the vector matmul on a tile copy (a third)"
        second = " (no oneDNN copy: every step takes the vector matmul or MKL's)" if onednn_unread(dtype) \
            and copies > 1 else " for oneDNN (a second copy of each)"
        log.info("%d linear weights prepacked%s%s", prepacked, second, third)
    # Prompt-sized steps fuse silu and the product into oneDNN. Not in float32: its fused epilogues would apply
    # swish where the reference rounds first.
    fused = fuse_gated_mlps(model) if prepacked and dtype != torch.float32 else 0
    # RMSNorms of prompt-sized steps in one C call (bf16: rms_norm.c, fp32: a loop in dispatch.cpp); decode steps
    # keep inductor's. The fused layers below need the swap (it checks the formula).
    norms = swap_rms_norms(model) if prepacked and dtype in FUSED_DTYPES and native.available() else 0
    # The linear, MLP and attention ops' kernels in C++ from now on (~7 us less a call, ~180 calls a decode step)
    native_ops = bool(prepacked) and native.available() and dispatch_natively()
    # The C++ linears skip zero rows, so zeroing the rows nobody reads makes the last MLP cheaper; elsewhere it
    # would cost a pass and save nothing.
    kept = native_ops and swap_last_layer(model)
    # Two op calls a layer (one op a step where every layer is fused) instead of ~11 calls and kernels from the
    # graph's Python: the unfused layer's roundings in bf16, eager's formulas in fp32 (graphs of a fifth of the
    # unfused one's compile time; fp32 steps take as long either way)
    layers = swap_fused_layers(model) if native_ops and norms and dtype in FUSED_DTYPES else 0
    return ModuleSwaps(prepacked, fused, norms, kept, layers)


def _copies_that_fit(model: torch.nn.Module) -> int:
    """How many extra copies of the linear weights memory allows, 0-2: oneDNN's packed copy, then the tile copy.
    Each stays unmade unless it leaves MEMORY_RESERVE free: a model that fits only plainly runs plainly (slower)
    rather than failing at start-up. (The KV cache is allocated before, so what it takes is already gone. An int8
    copy, asked for by name, is made either way.)"""
    free = available_memory()
    if free is None:
        return 2
    weights = packable_bytes(model)
    fits = 2 if 2 * weights + MEMORY_RESERVE <= free else 1 if weights + MEMORY_RESERVE <= free else 0
    if fits < 2:
        log.warning("%d MiB available: %s (each copy of the linear weights takes %d MiB)", free >> 20,
                    "no tile copies" if fits else "no packed copies, plain linears (slower)", weights >> 20)
    return fits
