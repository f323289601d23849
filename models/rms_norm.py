"""RMSNorm of prompt-sized steps as one C call (bf16: models/csrc/rms_norm.c), decode-sized steps left to inductor.

transformers' Llama-style RMSNorm is `weight * bf16(x * rsqrt(mean(x^2) + eps))` with x and the mean in fp32.
Inductor fuses it with the residual add before it into one kernel that converts each element between bf16 and
fp32 several times (emulating eager's roundings) and recomputes the add: ~60-75 us a call at 256 rows of 576,
~380 us at 1024 (one thread), 10% of a 1024-token prompt's step in a py-spy profile. The kernel takes ~31 / ~130
us (the add stays with inductor). Measured in whole steps (SmolLM2-135M, medians of three alternated processes):
a 1024-token solo step 309.7 -> 296.4 ms, 512 tokens 151.3 -> 142.7, a 256-token prefill 88.1 -> 84.3, a mixed
step of 256 prompt tokens 97.3 -> 94.5.

A decode step's few rows cost inductor a few microseconds, less than a call into an op (~8 us of dispatch and
Python), so the swapped module picks at trace time, from the step's static shape: the op from NATIVE_MIN_ROWS
rows, else the eager formula (which inductor fuses as before).

Only models with prepacked weights and the native kernels are swapped, only norms over the hidden size, and only
those whose own forward gives this formula's output exactly (checked on a probe input at the swap: variants such as
Gemma's `(1 + weight)` or OLMo-2's single rounding keep their own). In float32 the op's C++ kernel is a plain loop
(dispatch.cpp; its mean sums in its own order, as inductor's does: fp32 stays token-identical to transformers); the
fused fp32 decoder layers (models/fused_layer.py) call it at every size.
"""

from __future__ import annotations

import torch
from torch import nn

from models import native, native_dispatch

NATIVE_MIN_ROWS = 64  # rows (tokens) from which a step's norms run in the kernel: see the module docstring
# the dtypes whose norms are swapped (and take the op from NATIVE_MIN_ROWS rows): bf16's kernel is rms_norm.c, fp32's
# a loop in dispatch.cpp
SWAPPED_DTYPES = (torch.bfloat16, torch.float32)

_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D], the formula of transformers' LlamaRMSNorm (and its copies)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()  # the output is contiguous and of x's dtype on both paths, as the fake declares
    out = native.rms_norm(x, weight, eps)
    return out if out is not None else eager_rms_norm(x, weight, eps).to(x.dtype).contiguous()


def _rms_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# the Python kernel, until native_dispatch.install() puts the C++ one (same choices) in its place
native_dispatch.PY_CPU.impl("rms_norm", _rms_cpu)
torch.library.register_fake("bucketserve::rms_norm", _rms_fake, lib=_LIB)


class NativeRMSNorm(nn.Module):
    """What a swapped norm's class becomes (a class swap: same weight and epsilon)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states [..., D]; the row count is static in a compiled step, so this branch is taken at trace time
        rows = hidden_states.numel() // hidden_states.shape[-1]
        if rows >= NATIVE_MIN_ROWS and hidden_states.dtype in SWAPPED_DTYPES:
            out: torch.Tensor = torch.ops.bucketserve.rms_norm(hidden_states, self.weight,
                                                               float(self.variance_epsilon))
            return out
        return eager_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _swappable(module: nn.Module, dim: int) -> bool:
    """A `*RMSNorm` over the hidden size `dim` (not a per-head norm: its rows would be tokens x heads), with a bf16
    or fp32 [dim] weight and a float `variance_epsilon`, whose own forward gives eager_rms_norm's output exactly (a
    variant that rounds once, as OLMo-2's `(weight * h).to(bf16)`, or adds one, as Gemma's, differs)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if (type(module) is NativeRMSNorm or not type(module).__name__.endswith("RMSNorm")
            or not isinstance(weight, torch.Tensor) or weight.shape != (dim,) or weight.dtype not in SWAPPED_DTYPES
            or not isinstance(eps, float)):
        return False
    probe = (torch.randn(8, dim, generator=torch.Generator().manual_seed(0)) * 4).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            got = type(module).forward(module, probe)  # the class's forward: no hooks run
        except Exception:  # noqa: BLE001 - a norm that cannot run this probe is not one we know
            return False
        want = eager_rms_norm(probe, weight, eps)
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


def swap_rms_norms(model: nn.Module) -> int:
    """Swap every hidden-size RMSNorm of a bf16 or fp32 `model` that computes the Llama formula to NativeRMSNorm;
    returns how many."""
    dim = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(dim, int) or dim % 16:  # the kernel takes multiples of 16
        return 0
    found = [m for m in model.modules() if _swappable(m, dim)]
    for module in found:
        module.__class__ = NativeRMSNorm
    return len(found)
