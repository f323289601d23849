"""Llama-shaped decoder layers of mixed, verify and decode steps as two C++ op calls, and all of them as one where
every layer is swapped (a CPU module swap, models/module_swaps.py; the ops' kernels are models/csrc/layer_ops.cpp).

Why: a decoder layer in a compiled step is ~7 op calls (the RMSNorm, q / k / v / o projections, attention, gated MLP,
down projection) and ~4 inductor kernels (rotary halves, the rotary sum with the cache write, residual adds with
norms), each called from the graph's Python wrapper with its size asserts and allocations. A batch-8 decode step
(30 layers, 15.7 ms, one thread, AMD EPYC Zen 5; perf) spent ~3 ms outside the linears and the attention: Python,
the dispatcher and those small kernels. The swapped layer calls

    q, k, v = bucketserve::qkv_rope(x, ...)          input RMSNorm, q / k / v projections, rotary on q and k
    cache.update(k, v)                              the step's K/V write, in the graph as before (slot_cache.py)
    out = bucketserve::attn_mlp(x, q, cache, ...)   attention, o projection, residual, RMSNorm, gated MLP, residual

and the C++ kernels call the unfused layer's own kernels (the same choices, the same bits), so a layer is two op
calls and one inductor kernel.

Where every decoder layer of the model is swapped (and they share the norms' eps, the attention scale and the head
dim), the first layer runs them all as one `bucketserve::decoder_stack` call (qkv_rope, the K/V write and attn_mlp a
layer, in C++: layer_ops.cpp) and the others pass its output on: the graph calls one op a step instead of 90 calls
from its Python. The op declares the caches it writes (`Tensor(a!)[]`): inductor calls it on the cache buffers in
place, as it ran the graph's index_copy_ (no copies in the generated code).

Which layers: transformers' LlamaDecoderLayer with LlamaAttention (or session 49's kept-rows swap of it; a
subclass may compute otherwise), whose projections and MLP are the prepacked, bias-free, SiLU-gated ones and whose
norms are the native RMSNorm (so their formula was checked: models/rms_norm.py), in bf16 or fp32 with the C++
kernels installed. tests/models/test_fused_layer.py runs the installed transformers' layer against the ops, bit for
bit. In fp32 the ops compute the rotary, residual adds and SiLU product with eager's formulas and the norms in
dispatch.cpp's loop, where the unfused compiled layer ran inductor's kernels for them; fp32 stays token-identical
to transformers (`bucketserve verify`). Why there: its step time is level (a batch-8 decode step 50.6 against 49.8
ms, a 128-token mixed step 348 against 345, the Zen 3 EPYC, alternated), but a stacked graph compiles in ~9 s where
the unfused one took ~45: the fp32 table's cold warm-up 164 s against 426-547 (docs/performance.md, session 57).
Which steps: those with the slot cache's mixed or decode layers (mixed, verify and decode graphs); a prefill or chunk
step, or any other call, runs the layer's own forward. The last layer keeps its kept-rows MLP
(models/kept_rows.py): the op zeroes the MLP input of the rows whose logits the step does not keep.
"""

from __future__ import annotations

from typing import Any

import torch

from models import gated_mlp, kept_rows
from models.gated_mlp import GatedSiLUMLP
from models.prepack import PrepackedLinear
from models.rms_norm import NativeRMSNorm
from models.slot_cache import DecodeCache, MixedCache

# Exactly these classes, or their kept-rows swap (Mistral's layer passes a sliding window to its attention: not fused)
LAYER_TYPES = frozenset({"LlamaDecoderLayer"})
# bf16: the unfused layer's kernels and roundings; fp32: its linears and attention kernels, the rotary and residual
# adds as loops with eager's roundings, the norms in dispatch.cpp's loop, the SiLU product in ATen's ops
FUSED_DTYPES = (torch.bfloat16, torch.float32)
ATTENTION_TYPE = "LlamaAttention"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("qkv_rope(Tensor x, Tensor norm, float eps, Tensor wq, Tensor wk, Tensor wv, Tensor cos, Tensor sin, "
            "int head_dim) -> (Tensor, Tensor, Tensor)")
_LIB.define("attn_mlp(Tensor x, Tensor q, Tensor key, Tensor value, Tensor mask, Tensor wo, Tensor norm, float eps, "
            "Tensor wg, Tensor wu, Tensor wd, Tensor? kept, float scale, int head_dim) -> Tensor")
# Every layer of a step in one call: qkv_rope, the K/V write and attn_mlp per layer, in C++ (mutates keys / values:
# inductor calls it on the cache buffers in place, as it ran the graph's index_copy_)
_LIB.define("decoder_stack(Tensor x, Tensor[] weights, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor mask, "
            "Tensor cos, Tensor sin, Tensor write, Tensor? kept, float eps, float scale, int head_dim) -> Tensor")


def _qkv_rope_fake(x: torch.Tensor, norm: torch.Tensor, eps: float, wq: torch.Tensor, wk: torch.Tensor,
                   wv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [b, T, E] -> q [b, T, H * D], k, v [b, T, H_kv * D], contiguous."""
    return tuple(x.new_empty((*x.shape[:-1], w.shape[0])) for w in (wq, wk, wv))  # type: ignore[return-value]


def _attn_mlp_fake(x: torch.Tensor, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   wo: torch.Tensor, norm: torch.Tensor, eps: float, wg: torch.Tensor, wu: torch.Tensor,
                   wd: torch.Tensor, kept: torch.Tensor | None, scale: float, head_dim: int) -> torch.Tensor:
    """-> [b, T, E] contiguous, the layer's output."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _decoder_stack_fake(x: torch.Tensor, weights: list[torch.Tensor], keys: list[torch.Tensor],
                        values: list[torch.Tensor], mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        write: torch.Tensor, kept: torch.Tensor | None, eps: float, scale: float,
                        head_dim: int) -> torch.Tensor:
    """-> [b, T, E] contiguous, the last layer's output."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


torch.library.register_fake("bucketserve::qkv_rope", _qkv_rope_fake, lib=_LIB)
torch.library.register_fake("bucketserve::attn_mlp", _attn_mlp_fake, lib=_LIB)
torch.library.register_fake("bucketserve::decoder_stack", _decoder_stack_fake, lib=_LIB)
_SWAPPED: dict[type, type] = {}


def _takes(hidden: torch.Tensor, mask: Any, cache: Any, embeddings: Any) -> bool:
    """Whether this call is a step the ops serve (decided at trace time: types, dtypes and static shapes)."""
    if not isinstance(mask, torch.Tensor) or embeddings is None or hidden.dtype not in FUSED_DTYPES \
            or hidden.dim() != 3 or mask.dim() != 4:
        return False
    if isinstance(cache, MixedCache):  # (slot, position) per token
        return mask.dtype == torch.long and hidden.shape[0] == 1 and mask.shape[2] == hidden.shape[1]
    return isinstance(cache, DecodeCache) and mask.is_floating_point() and hidden.shape[1] == 1 \
        and mask.shape[2] == 1 and mask.shape[0] == hidden.shape[0]


def _forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
             position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer as qkv_rope, the cache write and attn_mlp; any other call goes to the layer's own forward.
    hidden_states [b, T, E]; position_embeddings (cos, sin) [b or 1, T, D]."""
    base: Any = self._fused_base
    if not _takes(hidden_states, attention_mask, cache, position_embeddings):
        out: torch.Tensor = base.forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                         cache=cache, use_cache=use_cache,
                                         position_embeddings=position_embeddings, **kwargs)
        return out
    stack: tuple[Any, ...] | None = self.__dict__.get("_stack")
    if stack is not None:  # one op runs every layer, from the first: the others pass its output on
        if self is not stack[0]:
            return hidden_states
        assert attention_mask is not None and position_embeddings is not None  # _takes checked both
        return _stack_forward(stack, hidden_states, attention_mask, cache, position_embeddings, kwargs)
    kept = kwargs.pop("kept_rows", None) if kept_rows.keeps_rows(base) else None
    attn, mlp = self.self_attn, self.mlp
    dim = attn.head_dim
    cos, sin = position_embeddings  # type: ignore[misc]
    q, k, v = torch.ops.bucketserve.qkv_rope(hidden_states, self.input_layernorm.weight,
                                             float(self.input_layernorm.variance_epsilon), attn.q_proj.weight,
                                             attn.k_proj.weight, attn.v_proj.weight, cos, sin, dim)
    b, t = hidden_states.shape[:2]
    keys, values = cache.update(k.view(b, t, -1, dim).transpose(1, 2), v.view(b, t, -1, dim).transpose(1, 2),
                                attn.layer_idx)
    out = torch.ops.bucketserve.attn_mlp(hidden_states, q, keys, values, attention_mask, attn.o_proj.weight,
                                         self.post_attention_layernorm.weight,
                                         float(self.post_attention_layernorm.variance_epsilon), mlp.gate_proj.weight,
                                         mlp.up_proj.weight, mlp.down_proj.weight, kept, float(attn.scaling), dim)
    return out


def _stack_forward(stack: tuple[Any, ...], hidden_states: torch.Tensor, mask: torch.Tensor, cache: Any,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor], kwargs: dict[str, Any]) -> torch.Tensor:
    """Every layer of `stack` (the model's, in order) as one bucketserve::decoder_stack call. hidden_states
    [b, T, E]; the K/V go where the cache's layers would write them: a decode step's rows at cache.write_pos [b], a
    mixed or verify step's tokens at cache.meta [T, 2] (slot, position)."""
    last = stack[-1]
    kept = kwargs.pop("kept_rows", None) if kept_rows.keeps_rows(last._fused_base) else None
    weights = [w for layer in stack for w in (
        layer.input_layernorm.weight, layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
        layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
        layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight)]
    layers = [cache.layers[layer.self_attn.layer_idx] for layer in stack]
    write = cache.meta if isinstance(cache, MixedCache) else cache.write_pos
    cos, sin = position_embeddings
    first = stack[0]
    out: torch.Tensor = torch.ops.bucketserve.decoder_stack(
        hidden_states, weights, [layer.k for layer in layers], [layer.v for layer in layers], mask, cos, sin, write,
        kept, float(first.input_layernorm.variance_epsilon), float(first.self_attn.scaling), first.self_attn.head_dim)
    return out


def _stackable(layers: list[Any]) -> bool:
    """Whether one decoder_stack call may run `layers` (every decoder layer of the model, all fused): layer i's
    cache layer is i, and the norms' eps, the attention scale and the head dim are the same in every layer (the op
    takes one of each)."""
    first = layers[0]
    eps = float(first.input_layernorm.variance_epsilon)
    return all(
        getattr(layer.self_attn, "layer_idx", None) == i
        and float(layer.input_layernorm.variance_epsilon) == eps
        and float(layer.post_attention_layernorm.variance_epsilon) == eps
        and layer.self_attn.scaling == first.self_attn.scaling
        and layer.self_attn.head_dim == first.self_attn.head_dim
        for i, layer in enumerate(layers))


def _fusable(layer: torch.nn.Module) -> bool:
    """A LAYER_TYPES layer with ATTENTION_TYPE attention, bias-free prepacked projections of one FUSED_DTYPES dtype,
    a SiLU-gated MLP without biases (fused, or in fp32, where the MLPs stay unfused, one gated_mlp would fuse: the
    same formula), native RMSNorms, and an even head dim."""
    cls = type(layer)
    if (cls.__bases__[0] if kept_rows.keeps_rows(cls) else cls).__name__ not in LAYER_TYPES:
        return False
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(attn).__name__ != ATTENTION_TYPE or mlp is None or not (type(mlp) is GatedSiLUMLP or gated_mlp.fusable(mlp)):
        return False
    linears = [getattr(attn, name, None) for name in PROJECTIONS]
    linears += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    dim = getattr(attn, "head_dim", 0)
    q_proj = getattr(attn, "q_proj", None)
    dtype = q_proj.weight.dtype if isinstance(q_proj, PrepackedLinear) else None
    return (dtype in FUSED_DTYPES
            and all(type(m) is PrepackedLinear and m.bias is None and m.weight.dtype is dtype for m in linears)
            and all(type(n) is NativeRMSNorm for n in norms) and isinstance(dim, int) and dim > 0 and dim % 2 == 0
            and isinstance(getattr(attn, "scaling", None), float) and isinstance(getattr(attn, "layer_idx", None), int))


def swap_fused_layers(model: torch.nn.Module) -> int:
    """Swap every fusable decoder layer's class for one that calls the two ops; returns how many."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return 0
    found = [layer for layer in layers if _fusable(layer)]
    for layer in found:
        cls = type(layer)
        if cls not in _SWAPPED:
            _SWAPPED[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": _forward, "_fused_base": cls})
        layer.__class__ = _SWAPPED[cls]
    if found and len(found) == len(layers) and _stackable(found):
        stack = tuple(found)
        for layer in found:  # a plain attribute (not a submodule): the layers stay where they were
            layer.__dict__["_stack"] = stack
    return len(found)
