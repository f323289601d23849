"""The prompt attention kernel (models/csrc/piece_attention.c): a piece of n tokens at positions start..start+n-1
attends causally over its slot; bf16 (AMX tiles, or AVX512-BF16 vector products without them) equals float32
attention to bf16 rounding, fp32 equals it to fp32 rounding; it never reads a position past the piece, takes
strided queries and keys (a prefill's keys are a transposed view), declines what it cannot take; mixed steps'
prompt pieces and causal prefills use it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from models import native, native_library, native_matmul
from models.attention import _causal_attention_cpu, packed_sdpa, register
from models.mixed_attention import _mixed_attention_cpu
from tests.models.test_attention import FakeAttention
from tests.models.test_native_kernels import threads  # noqa: F401 (the fixture: 1 and 2 threads)

needs_kernel = pytest.mark.skipif(not (native.available() and native.has("matmul")),
                                  reason="the kernel needs AVX512-BF16 (the CPU path falls back to SDPA)")


def _kernel_or_skip(dtype: torch.dtype) -> None:
    """bf16 pieces need the AVX512-BF16 kernel; fp32 ones its AVX-512 form or piece_avx2.c's (AVX2 without
    AVX-512)."""
    if not (native.available() and native.has("piece_f32" if dtype == torch.float32 else "matmul")):
        pytest.skip(f"no {dtype} piece kernel on this CPU (SDPA serves)")


@pytest.fixture(params=["tiles", "vector"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The bf16 products: AMX tiles (where this CPU has them) or vector dot products (forced on AMX CPUs)."""
    if request.param == "tiles" and not native_matmul.amx_available():
        pytest.skip("no AMX here")
    if request.param == "vector":
        monkeypatch.setitem(native_library._state, "amx", False)
    return str(request.param)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """float32 attention: q [H, n, D] at positions start.., k/v [H_kv, >= start + n, D] -> [H, n, D]."""
    end = start + q.shape[1]
    seen = torch.arange(end)[None] <= torch.arange(start, end)[:, None]
    return F.scaled_dot_product_attention(q.float()[None], k[None, :, :end].float(), v[None, :, :end].float(),
                                          attn_mask=seen, scale=scale, enable_gqa=q.shape[0] != k.shape[0])[0]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 96)])
# pieces of up to 8 tokens are run_attention.c's on the tiles, else run_vec.c's: (0, 1), (100, 3), (15, 5) (a
# 16-position tile's edge), (60, 4) (one whole 64-position chunk), (150, 8) (three chunks; 24-32 query rows of a KV
# head: two blocks)
# fp32 on AVX2 (piece_avx2.c): blocks of 6 tokens, scores 16 positions at a time; (70, 130) fills the context
@pytest.mark.parametrize(("start", "n"), [(0, 1), (0, 40), (5, 16), (17, 33), (100, 3), (64, 64), (15, 5), (60, 4),
                                          (150, 8), (70, 130), (3, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.usefixtures("threads")  # 1 and 2 compute threads
def test_kernel_equals_float32_causal_attention(heads: int, kv_heads: int, dim: int, start: int, n: int,
                                                dtype: torch.dtype, path: str) -> None:
    _kernel_or_skip(dtype)
    if dtype == torch.float32 and path == "tiles":
        pytest.skip("fp32 has one path")
    torch.manual_seed(start * 7 + n + dim)
    context = 200
    k = torch.randn(kv_heads, context, dim).to(dtype)
    v = torch.randn(kv_heads, context, dim).to(dtype)
    k[:, start + n :], v[:, start + n :] = float("nan"), float("nan")  # past the piece: reading there shows
    q = torch.randn(n, heads, dim).to(dtype).transpose(0, 1)  # [H, n, D] viewed from [n, H, D], as in a step
    out = torch.full((n, heads, dim), float("nan")).to(dtype).transpose(0, 1)
    scale = dim ** -0.5
    assert native.piece_attention(q, k, v, out, start, scale)
    assert torch.isfinite(out).all()
    want = _reference(q, torch.nan_to_num(k), torch.nan_to_num(v), start, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5  # bf16: P and the result rounded to bf16
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [37, 5])  # a piece, and a run (bf16: run_attention.c or run_vec.c)
def test_kernel_reads_keys_with_a_position_stride(dtype: torch.dtype, path: str, n: int) -> None:
    """A prefill's keys are [H_kv, L, D] viewed from [L, H_kv, D]: positions H_kv * D elements apart."""
    _kernel_or_skip(dtype)
    torch.manual_seed(3)
    heads, kv_heads, dim = 6, 2, 64
    k = torch.randn(n, kv_heads, dim).to(dtype).transpose(0, 1)
    v = torch.randn(n, kv_heads, dim).to(dtype).transpose(0, 1)
    q = torch.randn(heads, n, dim).to(dtype)
    out = torch.empty_like(q)
    assert native.piece_attention(q, k, v, out, 0, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.float(), _reference(q, k, v, 0, 0.125), rtol=tol, atol=tol)


def test_kernel_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.randn(4, 8, 64), torch.randn(2, 32, 64)
    out = torch.zeros_like(q)
    assert not native.piece_attention(q.half(), k.half(), k.half(), out.half(), 0, 0.125)  # float16: SDPA
    assert not native.piece_attention(q.bfloat16(), k, k, out, 0, 0.125)  # mixed element types
    assert not native.piece_attention(q[..., :48], k[..., :48], k[..., :48], out[..., :48], 0, 0.1)  # fp32, D % 32
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
    monkeypatch.setattr("models.mixed_attention.piece_attention", counted)
    return calls


@needs_kernel
def test_mixed_step_prompt_pieces_use_the_kernel(monkeypatch: pytest.MonkeyPatch, piece_calls: list[bool]) -> None:
    """Two prompt pieces (slot 0 from position 0, slot 2 from 20) around a decoding row: the kernel's output is
    SDPA's to bf16 rounding; padding tokens stay zero (the op's Python kernel; its C++ one gives the same bits:
    test_native_dispatch.py)."""
    torch.manual_seed(4)
    kv, groups, dim, context = 2, 3, 64, 64
    pairs = [(0, p) for p in range(12)] + [(1, 30)] + [(2, p) for p in range(20, 29)] + [(3, 0)] * 2  # > SHORT_RUN
    meta = torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)
    q = torch.randn(1, kv * groups, len(pairs), dim).bfloat16()
    k, v = torch.randn(4, kv, context, dim).bfloat16(), torch.randn(4, kv, context, dim).bfloat16()
    ours = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    assert piece_calls == [True, True]
    monkeypatch.setitem(native_library._switch, "on", False)
    sdpa = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    assert piece_calls == [True, True, False, False]
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
    assert not ours[:, :, -2:].any()


@needs_kernel
def test_causal_prefill_attention_takes_the_kernel(piece_calls: list[bool]) -> None:
    """A prefill's attention goes to bucketserve::causal_attention, whose Python kernel calls the prompt kernel once
    per row (its C++ kernel does the same calls and gives the same bits: test_native_dispatch.py)."""
    torch.manual_seed(5)
    b, kv, groups, n, dim = 2, 2, 3, 24, 32
    q = torch.randn(b, n, kv * groups, dim).transpose(1, 2)  # [b, H, n, D] as transformers passes it
    k, v = torch.randn(b, n, kv, dim).transpose(1, 2), torch.randn(b, n, kv, dim).transpose(1, 2)
    module = FakeAttention()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    def routed(**kwargs: Any) -> tuple[torch.Tensor, int]:
        """packed_sdpa's output and how many causal_attention ops it called."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out, _ = packed_sdpa(module, **kwargs)
        return out, sum(e.name == "bucketserve::causal_attention" for e in prof.events())

    fp32, ops = routed(query=q, key=k, value=v, attention_mask=None, scaling=dim ** -0.5)
    assert ops == 1
    torch.testing.assert_close(fp32, want, rtol=1e-5, atol=1e-5)
    piece_calls.clear()  # the op above reached the Python kernel only where no test installed the C++ ones yet
    assert _causal_attention_cpu(q, k, v, dim ** -0.5).shape == q.shape and piece_calls == [True, True]  # per row
    ours, ops = routed(query=q.bfloat16(), key=k.bfloat16(), value=v.bfloat16(), attention_mask=None,
                       scaling=dim ** -0.5)
    assert ops == 1
    assert ours.shape == (b, n, kv * groups, dim) and ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), want, rtol=2e-2, atol=2e-2)
    _, ops = routed(query=q.bfloat16(), key=k.bfloat16(), value=v.bfloat16(), attention_mask=None,
                    scaling=dim ** -0.5, is_causal=False)
    assert ops == 0  # not causal: SDPA


@needs_kernel
def test_a_bf16_llama_gives_the_same_logits_with_the_kernel() -> None:
    """End to end in a transformers model (head dim 32): our attention function with the kernel (the causal
    attention op, whichever of its kernels serves it) against the same model on transformers' SDPA."""
    torch.manual_seed(6)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        stock = model(ids).logits.float()
        model.set_attn_implementation(register())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ours = model(ids).logits.float()
    names = [e.name for e in prof.events()]
    assert names.count("bucketserve::causal_attention") == 2  # both layers
    assert "aten::scaled_dot_product_attention" not in names  # the kernel ran (whichever kernel serves the op)
    torch.testing.assert_close(ours, stock, rtol=0.05, atol=0.05 * float(stock.abs().max()))


@needs_kernel
def test_verify_step_runs_equal_float32_attention() -> None:
    """A verify step's tokens through the C++ op: rows with their drafts (runs of 2-5 tokens of a slot, which go to
    run_attention.c, each prefetching the next run's slot), single rows, a prompt piece and padding. Every token
    equals float32 attention over its slot up to its own position, to bf16 rounding."""
    from models.native_dispatch import install

    assert install()
    torch.manual_seed(6)
    kv, groups, dim, context, slots = 3, 3, 64, 320, 6  # slot 6: the spare slot
    k, v = torch.randn(slots + 1, kv, context, dim).bfloat16(), torch.randn(slots + 1, kv, context, dim).bfloat16()
    pairs = ([(0, p) for p in range(200, 204)] + [(1, 63), (1, 64)] + [(2, 17)] + [(3, p) for p in range(290, 295)]
             + [(4, 130)] + [(5, p) for p in range(0, 12)] + [(6, 0)] * 3)
    meta = torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)
    q = torch.randn(1, len(pairs), kv * groups, dim).bfloat16().transpose(1, 2)  # [1, H, T, D], a view
    got = torch.ops.bucketserve.mixed_attention(q, k, v, meta, dim ** -0.5)
    for t, (slot, pos) in enumerate(pairs[:-3]):
        want = _reference(q[0, :, t : t + 1], k[slot], v[slot], pos, dim ** -0.5)
        torch.testing.assert_close(got[0, :, t : t + 1].float(), want, rtol=2e-2, atol=2e-2, msg=f"token {t}")
    assert not got[0, :, -3:].any()


@pytest.mark.skipif(not native.available(), reason="no native kernels (no C compiler)")
def test_float32_verify_runs_give_their_decoding_rows_bits() -> None:
    """fp32 runs (a row and its drafts: decode_avx2.c's run entry, on AVX2 builds without AVX-512) read the slot's K/V
    once for the run; every token's output is the bits of the same token as a decoding row (the same tokens with the
    runs broken up, so each goes through the decode kernel alone), and fp32 attention up to its own position."""
    from models import native_library
    from models.native_dispatch import install

    assert install()
    torch.manual_seed(7)
    kv, groups, dim, context, slots = 3, 3, 64, 320, 4  # slot 4: the spare slot
    k, v = torch.randn(slots + 1, kv, context, dim), torch.randn(slots + 1, kv, context, dim)
    runs = [[(0, p) for p in range(200, 204)], [(1, 63), (1, 64)], [(2, 17)], [(3, p) for p in range(290, 298)]]
    pairs = [pair for run in runs for pair in run]
    q = torch.randn(1, len(pairs), kv * groups, dim)
    scale = dim ** -0.5

    def attend(order: list[int]) -> torch.Tensor:
        meta = torch.tensor([pairs[i] for i in order], dtype=torch.long).view(1, 1, len(order), 2)
        out = torch.ops.bucketserve.mixed_attention(q[:, order].transpose(1, 2), k, v, meta, scale)
        return out[0].transpose(0, 1)[torch.tensor(order).argsort()]  # [T, H, D] in pairs' order

    together = attend(list(range(len(pairs))))
    # the same tokens latest position first: no token follows its slot's position before it, so no run forms
    apart = attend(sorted(range(len(pairs)), key=lambda i: -pairs[i][1]))
    assert torch.equal(together, apart)
    for t, (slot, pos) in enumerate(pairs):
        want = _reference(q.transpose(1, 2)[0, :, t : t + 1], k[slot], v[slot], pos, scale)
        torch.testing.assert_close(together[t : t + 1].transpose(0, 1), want, rtol=1e-5, atol=1e-5)
    assert native_library.shortest_run_f32() in (0, 2)
