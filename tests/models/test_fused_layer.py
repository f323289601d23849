"""Decoder layers as two C++ ops (models/fused_layer.py, models/csrc/layer_ops.cpp): the ops round as the unfused
bf16 layer rounds, a fused runner's mixed, verify and decode steps give the unfused runner's logits bit for bit in
bf16 (compiled) and fp32 (eager: the fp32 ops compute the installed transformers' formulas with its roundings; the
unfused runner runs the installed transformers' Llama code: a release that changes it fails here), and only Llama
bf16 and fp32 layers on the native kernels are swapped."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

import models.module_swaps
import models.rms_norm
from buckets import BucketTable, GraphKey
from models import native, native_dispatch
from models.compile import CompileSettings
from models.loading import load_model
from models.prepack import supported
from models.rms_norm import eager_rms_norm
from models.runner import ModelRunner

needs_ops = pytest.mark.skipif(not (native.available() and native_dispatch.install()),
                               reason="needs the native kernels and their C++ ops (a C and a C++ compiler)")
needs_onednn = pytest.mark.skipif(not supported(torch.bfloat16, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")
# mixed and verify graphs of 8 and 16 tokens over 4 slots; 4 drafts a step at most
TABLE = BucketTable(lengths=(4, 8), batch_sizes=(4,), prefill_batch_sizes=(1,), context_length=48,
                    kv_lengths=(16, 48), chunked_prefill=True, mixed_tokens=(8, 16), draft_rows=4)


def _rotary(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, T, dim] bf16 for positions [rows, T] (Llama's default rope)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().bfloat16(), emb.sin().bfloat16()


@needs_ops
@pytest.mark.parametrize("dim", [64, 16, 48])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("switched_on", [True, False])
def test_qkv_rope_rounds_as_the_eager_layer(dim: int, decode: bool, switched_on: bool) -> None:
    """The op against eager bf16: RMSNorm (the op's), q / k / v projections, apply_rotary_pos_emb; head dims that
    fill 16 lanes and those that do not; a mixed step's one cos row per token and a decode step's one per row; with
    the native kernels off (--no-native-kernels) ATen's ops give the same bits."""
    torch.manual_seed(dim)
    heads, kv_heads, hidden = 4, 2, 96
    rows, tokens = (5, 1) if decode else (1, 9)
    x = torch.randn(rows, tokens, hidden).bfloat16()
    norm = (torch.randn(hidden) * 0.2 + 1).bfloat16()
    wq, wk, wv = (torch.randn(n * dim, hidden).bfloat16() * 0.1 for n in (heads, kv_heads, kv_heads))
    positions = torch.randint(0, 40, (rows, tokens))
    cos, sin = _rotary(positions, dim)
    h = torch.ops.bucketserve.rms_norm(x, norm, 1e-5)
    q = F.linear(h, wq).view(rows, tokens, heads, dim).transpose(1, 2)
    k = F.linear(h, wk).view(rows, tokens, kv_heads, dim).transpose(1, 2)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    was = native.enabled()
    native.configure(switched_on)
    try:
        got_q, got_k, got_v = torch.ops.bucketserve.qkv_rope(x, norm, 1e-5, wq, wk, wv, cos, sin, dim)
    finally:
        native.configure(was)
    assert torch.equal(got_q, want_q.transpose(1, 2).reshape(rows, tokens, heads * dim))
    assert torch.equal(got_k, want_k.transpose(1, 2).reshape(rows, tokens, kv_heads * dim))
    assert torch.equal(got_v, F.linear(h, wv))
    assert got_q.is_contiguous() and got_k.is_contiguous() and got_v.is_contiguous()  # as the fake declares


def _runner(path: str, fused: bool, monkeypatch: pytest.MonkeyPatch, dtype: str = "bfloat16",
            backend: str = "inductor") -> ModelRunner:
    if not fused:
        monkeypatch.setattr(models.module_swaps, "swap_fused_layers", lambda model: 0)
    runner = ModelRunner(load_model(path, dtype, "cpu"), TABLE, CompileSettings(backend=backend))
    monkeypatch.undo()
    return runner


@needs_ops
@pytest.mark.parametrize(("dtype", "backend"), [pytest.param("bfloat16", "inductor", marks=needs_onednn),
                                                ("float32", "eager")])
@pytest.mark.parametrize("stacked", [True, False])
def test_fused_steps_give_the_unfused_logits_bit_for_bit(tiny_llama: str, monkeypatch: pytest.MonkeyPatch,
                                                         stacked: bool, dtype: str, backend: str) -> None:
    """Mixed, verify and decode steps, one after another on the same slots (each reads what the last wrote), fused
    against unfused: every layer in one decoder_stack call (the default where every layer is fused), or two ops a
    layer. bf16, compiled: both take the native RMSNorm at every size (the unfused decode-sized steps would take
    inductor's formula, a rounding step apart at times), so the logits are equal, not merely close. fp32, eager:
    the unfused steps run transformers' own code (its norms the op at every size, as the fused layers'), whose
    formulas the fused ops compute with the same roundings (the compiled unfused fp32 layer runs inductor's kernels
    for the norms and adds, which may round otherwise)."""
    monkeypatch.setattr(models.rms_norm, "NATIVE_MIN_ROWS", 1)
    plain = _runner(tiny_llama, False, monkeypatch, dtype, backend)
    monkeypatch.setattr(models.rms_norm, "NATIVE_MIN_ROWS", 1)
    fused = _runner(tiny_llama, True, monkeypatch, dtype, backend)
    assert plain.fused_layers == 0 and fused.fused_layers == 2  # the tiny model's two layers
    if backend == "eager":  # the layers run their forward at each step (nothing traced): the op's norm from here on
        monkeypatch.setattr(models.rms_norm, "NATIVE_MIN_ROWS", 1)
    layers = fused.model.model.layers
    assert all(layer.__dict__.get("_stack") == tuple(layers) for layer in layers)
    if not stacked:
        for layer in layers:
            del layer.__dict__["_stack"]
    keys = [GraphKey("mixed", 4, 16), GraphKey("verify", TABLE.verify_rows, 8), GraphKey("decode", 4, 16),
            GraphKey("decode", 4, 48)]
    first, second = [11, 52, 7, 300, 41, 9], [88, 13, 250, 6, 70, 33, 2]
    steps: list[Callable[[ModelRunner], torch.Tensor]] = [
        # two prompts enter (13 tokens), their last tokens kept
        lambda r: r.mixed(16, first + second, [*range(6), *range(7)], [0] * 6 + [1] * 7, [5, 12])[:2],
        # a verify step: slots 0 and 1 each their token (at 6, 7) and 2 drafts (every token kept)
        lambda r: r.mixed(8, [5, 6, 8, 20, 21, 22], [6, 7, 8, 7, 8, 9], [0, 0, 0, 1, 1, 1], list(range(6)),
                          rows=TABLE.verify_rows)[:6],
        # decode steps over the batch of 4: slots 0 and 1 at 9 and 11, slots 2 and 3 free; KV buckets 16 (the
        # attention reads the buffers' first 16 positions) and 48 (all of them)
        lambda r: r.decode(4, torch.tensor([30, 31, 0, 0]), torch.tensor([9, 11, -1, -1]), 16)[:2],
        lambda r: r.decode(4, torch.tensor([32, 33, 0, 0]), torch.tensor([10, 12, -1, -1]), 48)[:2],
    ]
    try:
        for runner in (plain, fused):
            runner.warmup(keys)
        for step in steps:
            want = step(plain)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                got = step(fused)
            calls = [e.name for e in prof.events() if e.name.startswith("bucketserve::")]
            if stacked:  # one call for both layers (its kernels are called from C++, not through the dispatcher)
                assert calls.count("bucketserve::decoder_stack") == 1 and "bucketserve::qkv_rope" not in calls
            else:
                assert calls.count("bucketserve::qkv_rope") == calls.count("bucketserve::attn_mlp") == 2  # a layer each
                assert "bucketserve::decoder_stack" not in calls
            assert torch.isfinite(want.float()).all() and torch.equal(got, want)
        assert fused.accountant.count("serving") == 0
    finally:
        plain.stop_serving()
        fused.stop_serving()


@needs_ops
@needs_onednn
def test_only_llama_shaped_layers_on_the_native_ops_are_swapped(tiny_models: dict[str, str]) -> None:
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=16,
                        kv_lengths=(16,))

    def fused_layers(arch: str, dtype: str, **settings: bool) -> int:
        runner = ModelRunner(load_model(tiny_models[arch], dtype, "cpu"), table,
                             CompileSettings(backend="eager", **settings))  # type: ignore[arg-type]
        layers = runner.fused_layers
        runner.stop_serving()
        return layers

    assert fused_layers("llama", "bfloat16") == 2
    assert fused_layers("llama", "bfloat16", native_kernels=False) == 0  # --no-native-kernels
    assert fused_layers("qwen2", "bfloat16") == 0  # q / k / v biases
    assert fused_layers("gpt2", "bfloat16") == 0


@needs_ops
def test_fp32_llama_layers_on_the_native_ops_are_swapped(tiny_models: dict[str, str]) -> None:
    """fp32 (oneDNN packs fp32 on every x86 CPU): Llama's layers, not on --no-native-kernels, not with biases."""
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=16,
                        kv_lengths=(16,))

    def fused_layers(arch: str, **settings: bool) -> int:
        runner = ModelRunner(load_model(tiny_models[arch], "float32", "cpu"), table,
                             CompileSettings(backend="eager", **settings))  # type: ignore[arg-type]
        layers = runner.fused_layers
        runner.stop_serving()
        return layers

    assert fused_layers("llama") == 2
    assert fused_layers("llama", native_kernels=False) == 0
    assert fused_layers("qwen2") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_eager_rms_norm_is_the_formula_the_ops_assume(dtype: torch.dtype) -> None:
    """models/rms_norm.py's eager formula is the layer's (the fused op calls the norm op, which rounds as it)."""
    torch.manual_seed(3)
    x, weight = torch.randn(3, 64).to(dtype), (torch.randn(64) + 1).to(dtype)
    norm = modeling_llama.LlamaRMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(norm(x), eager_rms_norm(x, weight, 1e-6))
        # the op (its kernels sum the mean in their own order: a last bit apart at times)
        torch.testing.assert_close(torch.ops.bucketserve.rms_norm(x, weight, 1e-6), norm(x))


@needs_ops
def test_attn_mlp_runs_the_mlp_on_the_kept_rows_only() -> None:
    """With `kept`, the other rows leave the layer with only the attention added (their MLP input is zeroed, which
    the linears skip); the kept rows are what they are without it. A mixed step's call: 5 tokens of slot 0 at
    positions 0-4 over a cache of 2 slots and the spare one."""
    torch.manual_seed(5)
    heads, kv_heads, dim, hidden, tokens = 4, 2, 16, 64, 5
    x = torch.randn(1, tokens, hidden).bfloat16()
    q = torch.randn(1, tokens, heads * dim).bfloat16()
    key, value = (torch.randn(3, kv_heads, 8, dim).bfloat16() for _ in range(2))
    meta = torch.tensor([[0, p] for p in range(tokens)]).view(1, 1, tokens, 2)
    wo = torch.randn(hidden, heads * dim).bfloat16() * 0.1
    norm = (torch.randn(hidden) * 0.2 + 1).bfloat16()
    wg, wu = (torch.randn(96, hidden).bfloat16() * 0.1 for _ in range(2))
    wd = torch.randn(hidden, 96).bfloat16() * 0.1
    kept = torch.tensor([False, True, False, False, True]).view(1, tokens, 1)

    def layer(kept_rows: torch.Tensor | None, mlp: bool = True) -> torch.Tensor:
        w = (wg, wu, wd) if mlp else (wg * 0, wu * 0, wd * 0)
        out: torch.Tensor = torch.ops.bucketserve.attn_mlp(x, q, key, value, meta, wo, norm, 1e-5, *w, kept_rows,
                                                           0.25, dim)
        return out

    every, some, attention_only = layer(None), layer(kept), layer(None, mlp=False)
    assert torch.equal(some[0, [1, 4]], every[0, [1, 4]])
    assert torch.equal(some[0, [0, 2, 3]], attention_only[0, [0, 2, 3]])
    assert not torch.equal(every[0, 0], attention_only[0, 0])  # the MLP does add something to a row
