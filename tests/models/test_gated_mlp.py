"""Gated SiLU MLPs as one op (models/gated_mlp.py): the op computes silu(gate) * up whichever route its rows
take (oneDNN's fused epilogues for prompt-sized steps), and only prepacked gated-SiLU MLPs are swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from buckets import BucketTable, GraphKey
from models import native, native_matmul
from models.compile import CompileSettings
from models.gated_mlp import GatedSiLUMLP, _gated_cpu, fuse_gated_mlps
from models.loading import load_model
from models.native_matmul import SMALL_MATMUL_STEP_ROWS
from models.prepack import prepack, supported
from models.runner import ModelRunner, PrefillRow

pytestmark = pytest.mark.skipif(not supported(torch.bfloat16, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")


@pytest.mark.parametrize("rows", [1, 4, 16, 129, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_computes_silu_gate_times_up(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layers = nn.ModuleDict({"gate": nn.Linear(64, 96, bias=bias), "up": nn.Linear(64, 96, bias=bias)})
    layers = layers.bfloat16().requires_grad_(False)
    x = torch.randn(1, rows, 64).bfloat16()
    want = (nn.functional.silu(layers["gate"](x).float()) * layers["up"](x).float())
    prepack(layers)
    gate, up = layers["gate"], layers["up"]
    got = torch.ops.bucketserve.gated_silu(x, gate.weight, gate.bias, up.weight, up.bias)
    assert got.shape == (1, rows, 96) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_native_silu_takes_gates_of_every_magnitude() -> None:
    """Gates from -3e38 to 3e38 (through the one-call kernel: weights that copy x, so gate = up = x exactly): eager's
    bits, but for results below fp32's normal range, which the kernel's rounding flushes to zero (|silu| of a gate
    under ~-87), and no NaN."""
    if not native.available() or not (native_matmul.amx_available() or native_matmul.tiled_available()):
        pytest.skip("needs the native kernels and a tile kernel (the one-call path at 16 rows)")
    layers = nn.ModuleDict({"gate": nn.Linear(576, 1536, bias=False), "up": nn.Linear(576, 1536, bias=False)})
    eye = torch.zeros(1536, 576)
    eye[torch.arange(1536), torch.arange(1536) % 576] = 1.0  # output j = x[j % 576]
    for layer in layers.values():
        layer.weight.data.copy_(eye)
    layers = layers.bfloat16().requires_grad_(False)
    prepack(layers)
    values = torch.cat([torch.linspace(-120, 120, 16 * 576 - 8), torch.tensor([1e30, -1e30, 3e38, -3e38, 1e-30,
                                                                               -1e-30, 88.5, -88.5])])
    x = values.view(16, 1, 576).bfloat16()
    got = _gated_cpu(x, layers["gate"].weight, None, layers["up"].weight, None)
    want = nn.functional.silu(layers["gate"](x)) * layers["up"](x)
    assert not got.isnan().any()
    assert torch.equal(layers["gate"](x), x.repeat(1, 1, 3)[..., :1536])  # the gates are x itself
    tiny = nn.functional.silu(layers["gate"](x)).float().abs() < torch.finfo(torch.float32).tiny
    assert tiny.any() and (~tiny).any()  # gates under ~-87 give silu results below the normal range
    assert torch.equal(got[~tiny], want[~tiny]) and not got[tiny].float().abs().gt(0).any()


@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 16, 128])
def test_decode_sized_steps_take_one_native_call_rounded_as_eager(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                                  quantize: str) -> None:
    """Steps of 1-128 rows (no biases) run both matmuls, silu and the product in one C call (native_matmul.packed_gated),
    rounded as the unfused eager ops round (each to bf16): equal but for the rare element where the kernel's exp
    and PyTorch's land on two sides of a bf16 rounding boundary (one step apart)."""
    if not native.available() or (quantize == "int8" and not native_matmul.amx_available()):
        pytest.skip("needs the native kernels (int8: AMX)")
    if rows > SMALL_MATMUL_STEP_ROWS and not (native_matmul.amx_available() or native_matmul.tiled_available()):
        pytest.skip("steps of 3+ rows take the native call only with a tile kernel (oneDNN's fused matmuls here)")
    torch.manual_seed(rows)
    layers = nn.ModuleDict({"gate": nn.Linear(576, 1536, bias=False), "up": nn.Linear(576, 1536, bias=False)})
    layers = layers.bfloat16().requires_grad_(False)
    prepack(layers, quantize)
    gate, up = layers["gate"], layers["up"]
    x = torch.randn(rows, 1, 576).bfloat16()
    calls: list[int] = []
    real = native_matmul.packed_gated

    def counted(*args: object) -> torch.Tensor | None:
        out = real(*args)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr("models.gated_mlp.packed_gated", counted)
    got = _gated_cpu(x, gate.weight, None, up.weight, None)  # the op's Python kernel (C++: test_native_dispatch.py)
    assert calls == [True] and got.shape == (rows, 1, 1536) and got.dtype == torch.bfloat16
    want = nn.functional.silu(gate(x)) * up(x)  # the same kernels' matmuls, then eager silu and product
    assert (got != want).float().mean() < 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)  # one bf16 step at most


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prepacked_gated_mlps_are_swapped_and_give_the_same_logits(tiny_models: dict[str, str], arch: str) -> None:
    model = load_model(tiny_models[arch], "bfloat16", "cpu")
    ids = torch.tensor([[5, 9, 14, 33, 71, 2, 8, 100] * 20])  # 160 tokens: the oneDNN route
    with torch.no_grad():
        before = model(ids).logits.float()
        assert fuse_gated_mlps(model) == 0  # plain nn.Linear: not prepacked, nothing to fuse
        prepack(model)
        layers = model.config.num_hidden_layers
        assert fuse_gated_mlps(model) == layers and fuse_gated_mlps(model) == 0
        assert sum(type(m) is GatedSiLUMLP for m in model.modules()) == layers
        after = model(ids).logits.float()
    torch.testing.assert_close(after, before, rtol=0.05, atol=0.05 * float(before.abs().max()))


def test_only_gated_silu_mlps_and_prepacked_runners(tiny_models: dict[str, str], tiny_llama: str) -> None:
    gpt2 = load_model(tiny_models["gpt2"], "bfloat16", "cpu")
    prepack(gpt2)
    assert fuse_gated_mlps(gpt2) == 0  # no gate / up / down
    gelu = load_model(tiny_llama, "bfloat16", "cpu")
    prepack(gelu)
    for m in gelu.modules():
        if hasattr(m, "act_fn"):
            m.act_fn = nn.GELU()
    assert fuse_gated_mlps(gelu) == 0
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=32, kv_lengths=(32,))
    fp32 = ModelRunner(load_model(tiny_llama, "float32", "cpu"), table, CompileSettings(backend="inductor"))
    assert fp32.prepacked > 0 and fp32.fused_mlps == 0  # float32 keeps the reference's swish and product
    bf16 = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), table, CompileSettings(backend="inductor"))
    assert bf16.fused_mlps == 2
    bf16.warmup([GraphKey("prefill", 1, 8), GraphKey("decode", 1, 32)])
    logits = bf16.prefill([PrefillRow(0, [7, 9, 11])], 8, 1)
    assert torch.isfinite(logits).all() and bf16.accountant.count("serving") == 0
