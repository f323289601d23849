"""The float32 lm_head of greedy steps (models/csrc/greedy_head.c): while a step wants only each row's maximum from
its logits, the head finds it exactly from an int8 copy of the weight and the fp32 weight of a few candidates,
instead of reading the whole fp32 weight.

Why: below ~12 rows a float32 step is bound by reading its weights, and SmolLM2's 49152 x 576 head is 113 MB of
the 538 (21%). With the screen copy (28 MB) the head of a one-row step took 2.1-2.5 ms instead of 7.0-8.1 on the
Zen 3 EPYC (one thread); served, a one-row decode step 41.4 -> 34.3 ms and a verify step of ~3.5 tokens 50.2 ->
44.4 (p50s of step traces). Its estimate costs the full head's FMAs, so from ~8 rows it is no faster: steps of more
than `max_rows()` rows take the full head.

What a step gets: each row of its logits -inf but at the row's first maximum, which holds the logit the full head
computes (the same bits: greedy_head.c says why), so its argmax, and every draft's, is the full head's. The engine
asks for this only when nothing else reads the step's logits (every sampling row greedy, without logprobs or
penalties: server/engine/model.py); otherwise, and with the switch off, the kernel computes the full logits.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from models import native_library

# Model types whose logits are their head's output as it is: no bias, soft-capping or scaling after it (Gemma 2's
# final_logit_softcapping, Granite's logits_scaling, Cohere's logit_scale), which can round two different logits to
# the same value and so move the first maximum away from the one the head found.
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})
_PACK_ROWS = 4096  # vocabulary rows quantized at a time (a multiple of 32)


def available() -> bool:
    """The kernels are on and this build has the greedy head (AVX2 and FMA) and the fp32 tile copy it reads."""
    return native_library.available() and native_library.has("greedy_head") and native_library.has("f32")


def max_rows() -> int:
    """The most rows a step's head screens (greedy_head.c's SCREEN_MAX_ROWS); call after available()."""
    return int(native_library.lib().bucketserve_greedy_head_max_rows())


def screen_pack(weight: torch.Tensor, exact: tuple[int, torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | None:
    """weight [N, K] fp32 -> its screen copy: [N/32, K, 32] int8 (the fp32 tile copy's layout, f32_tile_pack), one
    scale a vocabulary row (max |w_v| / 127, q = round(w / scale): |w - q scale| <= scale / 2), followed by the N
    fp32 scales, the address of `weight` itself (where the kernel reads its candidates' rows: it must outlive
    the copy, as a packed weight's copies do) and `exact`, the weight's exact copy (models/exact_codes.py: its
    kernel kind, codes and scales; the full logits read it, and it too must outlive the screen copy) as three
    int64 (0, 0, 0 for none), as one int8 tensor of N * K + 4 N + 32 bytes. None where the kernel does not run here,
    `weight` is not contiguous, N is not a multiple of 32 or a weight is not finite (the bounds need finite
    weights)."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[0] % 32 or not weight.is_contiguous()
            or not available()):
        return None
    w = weight.detach()
    if not bool(torch.isfinite(w).all()):
        return None
    n, k = w.shape
    out = torch.empty(n * k + 4 * n + 32, dtype=torch.int8)
    tiles, scales = out[: n * k].view(n // 32, k, 32), out[n * k : n * k + 4 * n].view(torch.float32)
    for start in range(0, n, _PACK_ROWS):  # in blocks: a whole-weight fp32 temporary per step was ~4x the copy
        block = w[start : start + _PACK_ROWS]
        scale = (block.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(block / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        tiles[start // 32 : (start + block.shape[0]) // 32] = q.view(-1, 32, k).transpose(1, 2)
        scales[start : start + block.shape[0]] = scale
    trailer = [w.data_ptr(), *((exact[0], exact[1].data_ptr(), exact[2].data_ptr()) if exact else (0, 0, 0))]
    out[n * k + 4 * n :] = torch.tensor(trailer, dtype=torch.int64).view(torch.int8)
    return out


def head_of(model: nn.Module) -> nn.Linear | None:
    """The lm_head the greedy head may serve: the output embedding of a model of PLAIN_HEAD_TYPES, an nn.Linear
    without bias (None otherwise)."""
    config: Any = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_TYPES or not callable(get_head):
        return None
    head = get_head()
    return head if isinstance(head, nn.Linear) and head.bias is None else None


@functools.cache
def _switch() -> ctypes.c_int:
    """The kernel's switch (looked up once: the engine enters maxima_only every step)."""
    return ctypes.c_int.in_dll(native_library.lib(), "bucketserve_head_argmax")


@contextmanager
def maxima_only(on: bool = True) -> Iterator[None]:
    """Within: the greedy head gives each row's maximum alone (the engine thread's step; `on` False: no change)."""
    if not on or not available():
        yield
        return
    switch = _switch()
    switch.value = 1
    try:
        yield
    finally:
        switch.value = 0
