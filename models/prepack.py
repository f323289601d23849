"""Prepacked CPU linears: every `nn.Linear` of a bfloat16/float16 model (and of a float32 one, in steps of 2+ rows:
below) runs oneDNN's matmul on a copy of its weight reordered once into oneDNN's blocked layout, instead of
reordering the plain weight on every call.

Why: with plain weights oneDNN reorders each weight on every call; that reorder costs as much as the matmul
itself (measured here, one thread, bf16: 576x1536 weight 0.12 -> 0.055 ms at 1-16 rows, the 49152x576 lm_head
4.4-5.1 -> 2.3-2.4 ms). Inductor's freezing does the same reorder, but frozen graphs embed their weights and cannot
be saved as artifacts; this keeps the weights as graph inputs (artifacts stay small and portable) and moves only
the packed copy out of the graph: the graph calls the custom op `bucketserve::linear(x, weight, bias)`, whose
CPU kernel looks the packed copy up by the weight's address. A weight with no packed copy (never prepacked, or
a shape the op does not know) takes the plain `F.linear`: same result, just slower.

Steps of 2-128 rows take bucketserve's AMX matmul on a third copy in the tiles' layout where the CPU has AMX
(models/native_matmul.py: 1.1-1.4x oneDNN there: decode steps are memory-bound and oneDNN streams their weights at ~7
GB/s of one core's ~12), and one-row steps the vector matmul below on the same copy (Intel Xeon, one thread: the
211 weights of a step 22.0 ms against 24.1 for the small matmul on the plain weight; a batch-1 decode step 28.6 /
27.7 -> 25.3 / 26.2 ms); larger steps (prompts) stay with oneDNN there. Without AMX, steps of every size take the
vector matmul (AVX512-BF16) on the same tile copy (measured on a Zen 4 EPYC: 1.3x the small matmul at one row,
1.4-2x oneDNN at 1-16 rows, 1.1x at 64; on a Zen 5 EPYC 1.1-1.2x oneDNN at 128-1024 rows); where there is no tile
copy (N not a multiple of 32), 1-2 rows the small matmul and oneDNN the rest. Which kernel and copy each step
size reads is chosen once per weight (`Packed.kernel`), and the op calls it through one lean C entry
(models/csrc/linear.c): the per-call Python of choosing and checking cost ~2 us of a ~10 us one-row linear. Where
the op's C++ kernel is built (models/native_dispatch.py), it makes the same choice from a mirror of these entries,
without Python (~3 us a call through the op, against ~9).

With `--quantize int8` the tile copy is replaced by a weight-only int8 one (per output column, symmetric), which
steps of 1-128 rows read instead (one row included; the AMX kernel, or the vector one without AMX): decode is bound
by reading the weights, and int8 halves them. Steps of more rows (prompt pieces of 256 tokens) keep oneDNN on the
bf16 weight, so prompts are prefilled at bf16 precision and the tokens that follow are computed with the int8 weights.

Numerics: the same oneDNN bf16 kernel with fp32 accumulation as the plain path (outputs agree to the bf16
rounding; the small-row kernel sums in another order, also in fp32).

float32 (the reference dtype): steps of 1-32 rows (1-128 on CPUs with AVX2 and no AVX-512) take the fp32 vector
matmul on a fp32 tile copy
(models/csrc/tiled_matmul.c; AMD EPYC: 1.24x the plain-weight one-row kernel at one row, 1.8x oneDNN at 8 rows,
1.25x at 16; on AMX CPUs one row takes the one-row kernel, faster there), where there is none the native fp32
one-row matmul on the plain weight (models/csrc/small_matmul.c:
16 weight rows streamed at a time, ~1.5x MKL's sgemv here, fp32 sums in another order) for one row, or MKL's, as
transformers' eager path does, where the native kernels are off or do not take the weight; more rows oneDNN's
fp32 matmul on the packed copy. MKL's sgemm is slow at a few rows here (one thread, 8 rows:
0.35 ms for a 1536x576 weight against oneDNN's 0.18 from the packed copy, the lm_head 14.8 against 6.4 ms), and
oneDNN is as fast or faster up to prompt-sized steps. Its sums run in another order than MKL's: outputs differ by
fp32 rounding (~1e-5 here), as MKL's own batched and one-row results already did, and greedy tokens stay those
of transformers' eager float32 (`bucketserve verify --dtype float32`, the invariance tests). No fused MLP module in
float32 (its decoder layers run fused all the same: models/fused_layer.py).
Memory: the packed copy is a second copy of every linear weight (270 MB for SmolLM2-135M in bf16, 540 in fp32, none
in fp32 on AVX2 builds, whose steps never read it: `onednn_unread`), the
tile copy a third (and the lm_head's: 57 MB more in bf16 for SmolLM2's tied embeddings, 113 in fp32); the int8
copy, where it replaces the AMX one, half of the bf16 one; a fp32 lm_head's screen copy (models/greedy_head.py) a
quarter of its weight (28 MB for SmolLM2); an exact 4- or 8-bit copy (models/exact_codes.py), where it replaces the
fp32 tile copy, 0.19 or 0.28 of the weight (80 MB for SmolLM2's layers against 425; its head's, 32 MB, beside the
tile copy, which steps of 17+ rows read). The runner asks for the copies only where memory holds
them (models/module_swaps.py): where it is short the tile copy is left out first, then oneDNN's.
"""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models import exact_codes, greedy_head, huge_pages, native, native_dispatch
from models.compile import QUANTIZE_MODES
from models.hardware import MEMORY_RESERVE, available_memory
from models.native_matmul import (
    AMX,
    AMX_MAX_ROWS,
    EXACT4_F32,
    EXACT8_F32,
    GREEDY_HEAD_F32,
    ONE_ROW_F32,
    SMALL,
    SMALL_MATMUL_STEP_ROWS,
    TILED,
    TILED_F32,
    TILED_MAX_ROWS,
    Kernel,
    amx_available,
    f32_tile_pack,
    f32_tiles_take,
    int8_kind,
    int8_pack,
    one_row_f32_takes,
    packed_linear,
    small_matmul_takes,
    tile_pack,
    tiled_f32_rows,
)


class Packed(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    onednn: torch.Tensor  # oneDNN's blocked copy (prompt-sized steps), or the plain weight where none reads it
    tiles: torch.Tensor | None  # the tile copy (AMX: 2-128 rows; vector: any; fp32 vector: 1-32), or None
    int8: tuple[torch.Tensor, torch.Tensor] | None  # --quantize int8: (q, scale) for steps of 1-128 rows, or None
    one: Kernel | None  # what a one-row step reads (native_matmul.packed_linear), or None: oneDNN
    few: Kernel | None  # what steps of 2..few_max rows read, or None: oneDNN
    few_max: int
    # a fp32 lm_head's int8 screen copy (models/greedy_head.py) and the plain weight whose address it holds (kept
    # alive with it), or None
    screen: tuple[torch.Tensor, torch.Tensor] | None = None
    # a fp32 weight's exact 4- or 8-bit copy (models/exact_codes.py: codes, scales), read in place of the fp32 tile
    # copy, or None
    exact: tuple[torch.Tensor, torch.Tensor] | None = None

    def kernel(self, rows: int) -> Kernel | None:
        """The native kernel for a step of `rows` rows, or None: oneDNN (chosen once, at packing)."""
        return self.one if rows == 1 else self.few if 1 < rows <= self.few_max else None


def _packed(weight: torch.Tensor, onednn: torch.Tensor, quantize: str, tiles_too: bool = True, head: bool = False
            ) -> Packed:
    """The copies of `weight` (oneDNN's, and the tile or int8 tile copy) and which kernel each step size reads:
    int8 (1-128 rows) where quantized; with AMX the vector matmul for one row and the AMX tiles for 2-128; without,
    the vector matmul on the tile copy for every step size (the small matmul for 1-2 where there is no tile copy);
    float32: the fp32 vector matmul on its fp32 tile copy for 1 to tiled_f32_rows() rows (32 with AVX-512, 128 with
    AVX2 only; with AMX, or where there is no tile copy,
    the fp32 one-row matmul on the plain weight for one).
    Without `tiles_too` (memory is short) no tile copy: the kernels that read the plain weight, else oneDNN.
    `head`: the model's lm_head; in float32, where its steps read the fp32 tile copy, they read it through the greedy
    head (models/greedy_head.py), which computes the full logits unless a step asks for its maxima alone.
    A fp32 weight whose values are exactly small integer codes times a scale per block (models/exact_codes.py: a
    quantized checkpoint stored in fp32, as the default model is) gets that copy in place of the fp32 tile copy, for
    the same step sizes and the same bits (the head's full logits too)."""
    if weight.dtype == torch.float32:
        exact = _exact_copy(weight) if tiles_too and tiled_f32_rows() > 0 else None
        if exact is not None:
            kind, codes = exact
            screen = greedy_head.screen_pack(weight, (kind, *codes)) if head else None
            if screen is not None:  # the tiles too: the full logits of many rows read them (greedy_head.c)
                tiles32 = f32_tile_pack(weight)
                head_kernel: Kernel = (GREEDY_HEAD_F32, tiles32.data_ptr() if tiles32 is not None else 0,
                                       screen.data_ptr())
                return Packed(weight.shape, weight.dtype, onednn, tiles32, None, head_kernel, head_kernel,
                              tiled_f32_rows(), (screen, weight), codes)
            chosen: Kernel = (kind, codes[0].data_ptr(), codes[1].data_ptr())
            return Packed(weight.shape, weight.dtype, onednn, None, None, chosen, chosen, tiled_f32_rows(),
                          exact=codes)
        f32_tiles = f32_tile_pack(weight) if tiles_too else None
        one: Kernel | None = (ONE_ROW_F32, weight.data_ptr(), 0) if one_row_f32_takes(weight) else None
        if f32_tiles is not None:
            vector32: Kernel = (TILED_F32, f32_tiles.data_ptr(), 0)
            # One row: the kernel that streams this CPU's memory faster. On the AMD EPYC the tile copy (1.24x the
            # plain weight's); on the Intel Xeon with AMX the plain weight's 16 rows at a time (the step's 211
            # weights 40.5-41.5 ms against 43.2-44.4). Told apart by AMX, the one difference the kernels see.
            first = one if one is not None and amx_available() else vector32
            screen = greedy_head.screen_pack(weight) if head else None
            if screen is not None:  # the same sums as vector32's, and each row's maximum alone when a step asks
                greedy: Kernel = (GREEDY_HEAD_F32, f32_tiles.data_ptr(), screen.data_ptr())
                return Packed(weight.shape, weight.dtype, onednn, f32_tiles, None,
                              greedy if first is vector32 else first, greedy, tiled_f32_rows(), (screen, weight))
            return Packed(weight.shape, weight.dtype, onednn, f32_tiles, None, first, vector32, tiled_f32_rows())
        return Packed(weight.shape, weight.dtype, onednn, None, None, one, None, 1)
    q8 = int8_pack(weight) if quantize == "int8" else None
    tiles = tile_pack(weight) if q8 is None and tiles_too else None
    small: Kernel | None = (SMALL, weight.data_ptr(), 0) if small_matmul_takes(weight) else None
    if q8 is not None:
        int8: Kernel = (int8_kind(), q8[0].data_ptr(), q8[1].data_ptr())
        return Packed(weight.shape, weight.dtype, onednn, None, q8, int8, int8, AMX_MAX_ROWS)
    if tiles is not None and amx_available():
        amx: Kernel = (AMX, tiles.data_ptr(), 0)
        return Packed(weight.shape, weight.dtype, onednn, tiles, None, (TILED, tiles.data_ptr(), 0), amx, AMX_MAX_ROWS)
    if tiles is not None:
        vector: Kernel = (TILED, tiles.data_ptr(), 0)
        return Packed(weight.shape, weight.dtype, onednn, tiles, None, vector, vector, TILED_MAX_ROWS)
    return Packed(weight.shape, weight.dtype, onednn, None, None, small, small, SMALL_MATMUL_STEP_ROWS)


def _exact_copy(weight: torch.Tensor) -> tuple[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """The exact 4-bit copy of a fp32 weight, else its exact 8-bit copy, with the kernel kind that reads it; None
    where it has neither (the check stops at the first block that does not rebuild)."""
    four = exact_codes.pack4(weight)
    if four is not None:
        return EXACT4_F32, four
    eight = exact_codes.pack8(weight)
    return (EXACT8_F32, eight) if eight is not None else None


# weight's address -> its packed copies
_PACKED: dict[int, Packed] = {}
_LOCK = threading.Lock()
PACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The op is registered through torch.library.Library rather than the custom_op decorator: the decorator's
# Python layers cost ~11 us a call, 2-3 ms of a 211-linear step; this costs ~5 us over the oneDNN call itself.
_LIB = torch.library.Library("bucketserve", "FRAGMENT")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def packed_for(weight: torch.Tensor, x: torch.Tensor) -> Packed | None:
    """The packed copies of `weight` that an input like `x` may use (None: none, or another shape or dtype)."""
    entry = _PACKED.get(weight.data_ptr())
    return entry if entry is not None and entry.shape == weight.shape and x.dtype == weight.dtype else None


def _one_float32_row(x: torch.Tensor) -> bool:
    """A float32 input of one row: the fp32 one-row matmul on the plain weight, or MKL's (the reference's own
    kernel), is faster there than oneDNN's."""
    return x.dtype is torch.float32 and x.numel() == x.shape[-1]


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T + bias -> [..., out], through the packed copy when there is one (the
    op's CPU kernel; models/gated_mlp.py calls it directly)."""
    entry = packed_for(weight, x)
    if entry is None:
        return F.linear(x, weight, bias)
    one_f32 = _one_float32_row(x)
    kernel = entry.kernel(x.numel() // x.shape[-1]) if native.enabled() else None  # None for float16
    if kernel is not None:
        out = packed_linear(x if x.is_contiguous() else x.contiguous(), kernel, entry.shape[0])
        if out is not None:
            return out if bias is None else out.add_(bias)
    mkl_from = native.f32_mkl_rows() if x.dtype is torch.float32 and native.available() else 0
    if one_f32 or 0 < mkl_from <= x.numel() // x.shape[-1]:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # oneDNN takes [rows, in]
    dense: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, entry.onednn, bias, "none", [], "")
    return dense.view(*x.shape[:-1], weight.shape[0])


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# the Python kernel, until native_dispatch.install() puts the C++ one (same choices) in its place
native_dispatch.PY_CPU.impl("linear", linear_cpu)
torch.library.register_fake("bucketserve::linear", _linear_fake, lib=_LIB)


class PrepackedLinear(nn.Linear):
    """An nn.Linear whose forward is the `bucketserve::linear` op (same parameters, same module tree: a
    class swap, so hooks, names, tied weights and checkpoints are untouched)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.bucketserve.linear(input, self.weight, self.bias)
        return out


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Prepacking needs oneDNN on the CPU and a float dtype (float32: steps of 2+ rows, above) that oneDNN
    computes on this CPU: its bf16 reorder refuses a CPU without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (an AVX2
    Zen 3 EPYC, say), and fp16 needs its own instructions likewise."""
    if not (torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def onednn_unread(dtype: torch.dtype) -> bool:
    """Whether steps of `dtype` never read oneDNN's copy while the native kernels are on: fp32 where the vector
    matmul takes 1 to tiled_f32_rows() rows and MKL's matmul every longer step (AVX2 builds: 1-128 and 129+)."""
    if dtype != torch.float32 or not native.available():  # (available() loads the library the row counts come from)
        return False
    rows = tiled_f32_rows()
    return rows > 0 and native.f32_mkl_rows() == rows + 1


def _onednn_copy(weight: torch.Tensor, tiles_too: bool) -> torch.Tensor:
    """oneDNN's blocked copy of `weight`, or the plain weight itself where no step reads oneDNN's (onednn_unread,
    and the fp32 tile copy is made): oneDNN takes a plain weight too, reordering it at each call, which only a run
    with the native kernels switched off reaches. Why: on the Zen 3 EPYC the copy was 540 MB of SmolLM2's fp32
    weights that no step read."""
    if tiles_too and onednn_unread(weight.dtype) and f32_tiles_take(weight):
        return weight
    copy: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight)
    return copy


def prepack(model: nn.Module, quantize: str = "none", tiles: bool = True) -> int:
    """Swap every plain nn.Linear of `model` to PrepackedLinear and pack its weight (once: a weight shared by
    two modules, e.g. tied embeddings, or a model prepacked before). Returns how many distinct weights of the
    model now run prepacked. A packed copy lives as long as its weight (dropped when the weight is freed, so
    a reused address is never served a stale copy). The weights must not change afterwards (serving never
    writes them): a packed copy is not refreshed.

    quantize "int8": weight-only int8 (per output column) in place of the AMX kernel's bf16 copy, read by steps
    of 1-128 rows (decode, the lm_head, prompts and mixed steps of up to 128 tokens): half the bytes the
    memory-bound steps read. Larger steps keep oneDNN on the bf16 weights. Needs AMX or AVX512-BF16 (ValueError
    otherwise).

    tiles False: no tile copies (memory is short: models/module_swaps.py), so small steps take the kernels that
    read the plain weight or oneDNN; an int8 copy is made all the same (asked for by name)."""
    if quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    if quantize == "int8" and not int8_kind():
        raise ValueError("--quantize int8 needs a CPU with AMX or AVX512-BF16 (and the native kernels on): its "
                         "matmul converts the int8 weights for bf16 products")
    weights: set[int] = set()
    made: list[int] = []  # weights packed by this call
    head = greedy_head.head_of(model)
    for module in model.modules():
        if type(module) is nn.Linear and supported(module.weight.dtype, module.weight.device):
            weight = module.weight.detach()
            key = weight.data_ptr()
            with _LOCK:
                entry = _PACKED.get(key)
                if entry is None or (quantize == "int8") != (entry.int8 is not None):
                    onednn = _onednn_copy(weight, tiles) if entry is None else entry.onednn
                    _PACKED[key] = packed = _packed(weight, onednn, quantize, tiles, head=module is head)
                    _mirror(key, packed)
                    made.append(key)
                    if entry is None:
                        weakref.finalize(module.weight, _forget, key)
            module.__class__ = PrepackedLinear
        if type(module) is PrepackedLinear:
            weights.add(module.weight.data_ptr())
    _onto_huge_pages(made)
    return len(weights)


def _onto_huge_pages(keys: list[int]) -> None:
    """Move the bf16 tile copies of these packed weights into one buffer on huge pages (models/huge_pages.py),
    where memory allows the moment both are alive; each kernel that read the old copy reads the new one."""
    with _LOCK:
        moving = [(key, p, p.tiles) for key in keys if (p := _PACKED.get(key)) is not None
                  and p.tiles is not None and p.tiles.dtype == torch.bfloat16]
        size = sum(tiles.numel() * 2 for _, _, tiles in moving)
        free = available_memory()
        if not moving or (free is not None and free < size + MEMORY_RESERVE):
            return
        moved = huge_pages.copies([tiles for _, _, tiles in moving])
        for (key, old, tiles), new in zip(moving, moved):
            before, after = tiles.data_ptr(), new.data_ptr()
            one, few = (_reading(k, before, after) for k in (old.one, old.few))
            _PACKED[key] = packed = old._replace(tiles=new, one=one, few=few)
            _mirror(key, packed)  # the C++ kernels read the new copy from here on; the old one goes with `old`


def _reading(kernel: Kernel | None, before: int, after: int) -> Kernel | None:
    """`kernel` reading the copy at `after` where it read the one at `before`."""
    return (kernel[0], after, kernel[2]) if kernel is not None and kernel[1] == before else kernel


def packable_bytes(model: nn.Module) -> int:
    """Bytes of the distinct linear weights `prepack` would copy: what each of its copies costs (the int8 copy
    half of a bf16 one)."""
    weights = {m.weight.data_ptr(): m.weight for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype in PACKABLE_DTYPES}
    return sum(w.numel() * w.element_size() for w in weights.values())


def _forget(key: int) -> None:
    with _LOCK:
        _PACKED.pop(key, None)
        native_dispatch.forget(key)


def dispatch_natively() -> bool:
    """Serve the linear and gated MLP ops with their C++ kernels (models/native_dispatch.py) from now on, every
    packed weight mirrored there. True when they do."""
    with _LOCK:
        if not native_dispatch.install():
            return False
        for key, packed in _PACKED.items():
            _mirror(key, packed)
    return True


def _mirror(key: int, packed: Packed) -> None:
    """_LOCK held: tell the C++ kernels (once installed) about the packed copies of the weight at `key`."""
    native_dispatch.remember(key, packed.shape, packed.dtype, packed.onednn, packed.one, packed.few,
                             packed.few_max)


def packed_count() -> int:
    """How many packed weights are alive (tests)."""
    return len(_PACKED)
