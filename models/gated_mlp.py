"""Gated SiLU MLPs as one op, so prompt-sized steps fuse the activation and the product into oneDNN's matmuls.

transformers' Llama-style MLP is `down(silu(gate(x)) * up(x))`. With prepacked linears (models/prepack.py) the two
matmuls are opaque ops, and inductor runs silu and the product as a separate kernel over [tokens, intermediate]
(7.9 ms of a 101 ms 256-token prefill of SmolLM2-135M, bf16, one thread: exp and a divide per element). Here the
MLP calls `bucketserve::gated_silu(x, gate, up)` instead; where its matmuls run in oneDNN (prompt-sized steps),
the gate's matmul applies swish in its epilogue and the up matmul multiplies by that in its own (oneDNN post-ops),
so nothing is read or written twice (measured: 948 -> 757 us a layer at 256 rows). Smaller steps (decode: AMX, the
vector matmul on the tile copy or the small matmul) run both matmuls, silu and the product in one C call
(models/csrc/linear.c): their elementwise work is a few microseconds a layer, but as four PyTorch-level calls its
Python cost was ~20 us a layer.

Numerics: the fused epilogues apply swish to the fp32 sums before rounding to bf16, where eager rounds first (bf16
outputs differ by a rounding step); only bf16 / fp16 models are fused (models/module_swaps.py): float32 stays the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from models import native, native_dispatch
from models.native_matmul import packed_gated
from models.prepack import PrepackedLinear, linear_cpu, packed_for

_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("gated_silu(Tensor x, Tensor gate, Tensor? gate_bias, Tensor up, Tensor? up_bias) -> Tensor")


def _gated_cpu(x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None, up: torch.Tensor,
               up_bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] -> silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias): [..., out]."""
    g, u = packed_for(gate, x), packed_for(up, x)
    rows = x.reshape(-1, x.shape[-1])
    if g is not None and u is not None:
        # oneDNN (where the fused epilogues exist) for the step sizes prepack gives it; if a kernel of ours declines
        # at run time, the unfused path below still gives the same result, just unfused
        if g.kernel(rows.shape[0]) is None or u.kernel(rows.shape[0]) is None:
            rows = rows.contiguous()
            act = torch.ops.mkldnn._linear_pointwise(rows, g.onednn, gate_bias, "swish", [], "")
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(rows, act, u.onednn, up_bias, "mul")
            return out.view(*x.shape[:-1], up.shape[0])
        kg, ku = g.kernel(rows.shape[0]), u.kernel(rows.shape[0])
        if (kg is not None and ku is not None and gate_bias is None and up_bias is None and native.enabled()
                and x.dtype is torch.bfloat16):
            fused = packed_gated(x if x.is_contiguous() else x.contiguous(), kg, ku, up.shape[0])  # one C call
            if fused is not None:
                return fused
    return F.silu(linear_cpu(x, gate, gate_bias)) * linear_cpu(x, up, up_bias)


def _gated_fake(x: torch.Tensor, gate: torch.Tensor, gate_bias: torch.Tensor | None, up: torch.Tensor,
                up_bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], up.shape[0]))


# the Python kernel, until native_dispatch.install() puts the C++ one (same choices) in its place
native_dispatch.PY_CPU.impl("gated_silu", _gated_cpu)
torch.library.register_fake("bucketserve::gated_silu", _gated_fake, lib=_LIB)


class GatedSiLUMLP(nn.Module):
    """What a fused MLP's class becomes (a class swap: same submodules, names and weights)."""

    gate_proj: PrepackedLinear
    up_proj: PrepackedLinear
    down_proj: PrepackedLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = torch.ops.bucketserve.gated_silu(x, self.gate_proj.weight, self.gate_proj.bias,
                                                           self.up_proj.weight, self.up_proj.bias)
        out: torch.Tensor = self.down_proj(h)
        return out


def fusable(module: nn.Module) -> bool:
    """A transformers gated MLP (class named *MLP, exactly gate_proj / up_proj / down_proj / act_fn) with SiLU and
    prepacked linears."""
    children = dict(module.named_children())
    return (type(module) is not GatedSiLUMLP and type(module).__name__.endswith("MLP")
            and set(children) == {"gate_proj", "up_proj", "down_proj", "act_fn"}
            and all(type(children[name]) is PrepackedLinear for name in ("gate_proj", "up_proj", "down_proj"))
            and type(children["act_fn"]) in (SiLUActivation, nn.SiLU))


def fuse_gated_mlps(model: nn.Module) -> int:
    """Swap every fusable MLP of a prepacked `model` to GatedSiLUMLP; returns how many were swapped."""
    found = [m for m in model.modules() if fusable(m)]
    for module in found:
        module.__class__ = GatedSiLUMLP
    return len(found)
