"""The AMX kernel for prompt attention (models/csrc/piece_attention.c): a piece of n tokens at positions start..
start+n-1 attends causally over its slot; it equals float32 attention to bf16 rounding, never reads a position
past the piece, takes strided queries and keys (a prefill's keys are a transposed view), declines what it cannot
take; mixed steps' prompt pieces and bf16 prefills use it, float32 keeps SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from models import native, native_library
from models.attention import packed_sdpa, register
from tests.models.test_attention import FakeAttention
from tests.models.test_native_kernels import threads  # noqa: F401 (the fixture: 1 and 2 threads)

needs_amx = pytest.mark.skipif(not native.amx_available(), reason="the kernel needs AMX (the CPU path falls back)")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """float32 attention: q [H, n, D] at positions start.., k/v [H_kv, >= start + n, D] -> [H, n, D]."""
    end = start + q.shape[1]
    seen = torch.arange(end)[None] <= torch.arange(start, end)[:, None]
    return F.scaled_dot_product_attention(q.float()[None], k[None, :, :end].float(), v[None, :, :end].float(),
                                          attn_mask=seen, scale=scale, enable_gqa=q.shape[0] != k.shape[0])[0]


@needs_amx
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 96)])
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 40), (5, 16), (17, 33), (100, 3), (64, 64)])
@pytest.mark.usefixtures("threads")  # 1 and 2 compute threads
def test_kernel_equals_float32_causal_attention(heads: int, kv_heads: int, dim: int, start: int, n: int) -> None:
    torch.manual_seed(start * 7 + n + dim)
    context = 200
    k = torch.randn(kv_heads, context, dim).bfloat16()
    v = torch.randn(kv_heads, context, dim).bfloat16()
    k[:, start + n :], v[:, start + n :] = float("nan"), float("nan")  # past the piece: reading there shows
    q = torch.randn(n, heads, dim).bfloat16().transpose(0, 1)  # [H, n, D] viewed from [n, H, D], as in a step
    out = torch.full((n, heads, dim), float("nan")).bfloat16().transpose(0, 1)
    scale = dim ** -0.5
    assert native.piece_attention(q, k, v, out, start, scale)
    assert torch.isfinite(out).all()
    want = _reference(q, torch.nan_to_num(k), torch.nan_to_num(v), start, scale)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)  # P and the result rounded to bf16


@needs_amx
def test_kernel_reads_keys_with_a_position_stride() -> None:
    """A prefill's keys are [H_kv, L, D] viewed from [L, H_kv, D]: positions H_kv * D elements apart."""
    torch.manual_seed(3)
    n, heads, kv_heads, dim = 37, 6, 2, 64
    k = torch.randn(n, kv_heads, dim).bfloat16().transpose(0, 1)
    v = torch.randn(n, kv_heads, dim).bfloat16().transpose(0, 1)
    q = torch.randn(heads, n, dim).bfloat16()
    out = torch.empty_like(q)
    assert native.piece_attention(q, k, v, out, 0, 0.125)
    torch.testing.assert_close(out.float(), _reference(q, k, v, 0, 0.125), rtol=2e-2, atol=2e-2)


def test_kernel_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.randn(4, 8, 64), torch.randn(2, 32, 64)
    out = torch.zeros_like(q)
    assert not native.piece_attention(q, k, k, out, 0, 0.125)  # float32: the reference path, SDPA
    assert not out.any()
    q16, k16, o16 = q.bfloat16(), k.bfloat16(), out.bfloat16()
    assert not native.piece_attention(q16[..., :48], k16[..., :48], k16[..., :48], o16[..., :48], 0, 0.1)  # D % 32
    assert not native.piece_attention(q16, k16, k16, o16, 25, 0.125)  # 25 + 8 positions > the 32 there are
    assert not native.piece_attention(q16[:3], k16, k16, o16[:3], 0, 0.125)  # 3 heads over 2 KV heads
    monkeypatch.setitem(native_library._switch, "on", False)
    assert not native.piece_attention(q16, k16, k16, o16, 0, 0.125)


@pytest.fixture
def piece_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each call the attention ops make to the kernel: whether it ran (True) or declined (False)."""
    calls: list[bool] = []
    real = native.piece_attention

    def counted(*args: object) -> bool:
        ran = real(*args)  # type: ignore[arg-type]
        calls.append(ran)
        return ran

    monkeypatch.setattr("models.attention.piece_attention", counted)
    return calls


@needs_amx
def test_mixed_step_prompt_pieces_use_the_kernel(monkeypatch: pytest.MonkeyPatch, piece_calls: list[bool]) -> None:
    """Two prompt pieces (slot 0 from position 0, slot 2 from 20) around a decoding row: the kernel's output is
    SDPA's to bf16 rounding; padding tokens stay zero."""
    torch.manual_seed(4)
    kv, groups, dim, context = 2, 3, 64, 64
    pairs = [(0, p) for p in range(5)] + [(1, 30)] + [(2, p) for p in range(20, 29)] + [(3, 0)] * 2
    meta = torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)
    q = torch.randn(1, kv * groups, len(pairs), dim).bfloat16()
    k, v = torch.randn(4, kv, context, dim).bfloat16(), torch.randn(4, kv, context, dim).bfloat16()
    ours = torch.ops.bucketserve.mixed_attention(q, k, v, meta, dim ** -0.5)
    assert piece_calls == [True, True]
    monkeypatch.setitem(native_library._switch, "on", False)
    sdpa = torch.ops.bucketserve.mixed_attention(q, k, v, meta, dim ** -0.5)
    assert piece_calls == [True, True, False, False]
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
    assert not ours[:, :, -2:].any()


@needs_amx
def test_bf16_prefill_attention_takes_the_kernel_and_float32_keeps_sdpa(piece_calls: list[bool]) -> None:
    torch.manual_seed(5)
    b, kv, groups, n, dim = 2, 2, 3, 24, 32
    q = torch.randn(b, n, kv * groups, dim).transpose(1, 2)  # [b, H, n, D] as transformers passes it
    k, v = torch.randn(b, n, kv, dim).transpose(1, 2), torch.randn(b, n, kv, dim).transpose(1, 2)
    module = FakeAttention()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    fp32, _ = packed_sdpa(module, q, k, v, None, scaling=dim ** -0.5)
    assert piece_calls == [] and torch.allclose(fp32, want, atol=1e-5)
    ours, _ = packed_sdpa(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=dim ** -0.5)
    assert piece_calls == [True, True]  # one call per row
    assert ours.shape == (b, n, kv * groups, dim) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), want, rtol=2e-2, atol=2e-2)
    packed_sdpa(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, scaling=dim ** -0.5, is_causal=False)
    assert len(piece_calls) == 2  # not causal: SDPA


@needs_amx
def test_a_bf16_llama_gives_the_same_logits_with_the_kernel(monkeypatch: pytest.MonkeyPatch,
                                                            piece_calls: list[bool]) -> None:
    """End to end in a transformers model (head dim 32): our attention function with the kernel against the same
    model on transformers' SDPA."""
    torch.manual_seed(6)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        stock = model(ids).logits.float()
        model.set_attn_implementation(register())
        ours = model(ids).logits.float()
    assert piece_calls == [True, True]  # both layers
    torch.testing.assert_close(ours, stock, rtol=0.05, atol=0.05 * float(stock.abs().max()))
