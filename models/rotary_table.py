"""Rotary position tables: every step looks its rotary cos/sin up by position instead of computing them.

Why: transformers' rotary module computes cos and sin of (position x inverse frequency) on every forward, and
inductor inlines that pointwise work into each layer's rotary kernel, so every layer evaluates sin and cos
again for every query and key head (measured on SmolLM2-135M, bf16, one thread: the two rotary kernels cost
7.7 ms of a 101 ms 256-token prefill and 1.4 ms of a 39 ms batch-16 decode step). The positions a server sees
are bounded by its context length, so the module's own output for positions [0, context) is computed once,
eagerly, at load, and the step graphs gather rows of it: the same values the module returns (it is the module's
own forward that fills the tables), a load instead of two transcendental functions per element.

Applies to rotary modules of the transformers kind (`forward(x, position_ids) -> (cos, sin)`, an `inv_freq`
buffer) whose frequencies do not depend on the sequence: rope types "dynamic" and "longrope" recompute them
from the longest position seen, so they keep their own forward.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

# rope types whose frequencies change with the positions seen (transformers' dynamic_rope_update)
_DYNAMIC = ("dynamic", "longrope")


class RotaryTable(nn.Module):
    """Stands in for a rotary module: its output for positions [0, N), looked up. cos, sin: [N, D]."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] (each < N) -> cos, sin [B, T, D] in x's dtype, as the replaced module returned
        them."""
        cos: torch.Tensor = self.cos[position_ids]
        sin: torch.Tensor = self.sin[position_ids]
        return cos.to(x.dtype), sin.to(x.dtype)


def _eligible(module: nn.Module) -> bool:
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
        return False
    rope_type = getattr(module, "rope_type", "default")
    if not isinstance(rope_type, str) or rope_type in _DYNAMIC:
        return False  # per-layer-type rope (a dict) or frequencies that follow the sequence
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["x", "position_ids"]


@torch.no_grad()
def tabulate_rotary(model: nn.Module, positions: int, dtype: torch.dtype) -> int:
    """Replace every eligible rotary module of `model` by a RotaryTable of its own output for positions
    [0, positions) ([positions, D] in `dtype`, on the module's device). Returns how many were replaced (a
    model tabulated before has none left)."""
    if positions <= 0:
        raise ValueError(f"a rotary table needs positions > 0, got {positions}")
    found = [(name, module) for name, module in model.named_modules() if name and _eligible(module)]
    for name, module in found:
        device = module.inv_freq.device
        ids = torch.arange(positions, device=device).view(1, positions)
        cos, sin = module(torch.empty(0, dtype=dtype, device=device), ids)  # [1, positions, D] each
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, RotaryTable(cos[0].contiguous(), sin[0].contiguous()))
    return len(found)
