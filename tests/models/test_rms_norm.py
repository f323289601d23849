"""RMSNorm as one C call for prompt-sized bf16 steps (models/rms_norm.py): the op rounds as transformers' eager
bf16 RMSNorm rounds, only Llama-formula norms of prepacked bf16 runners are swapped, and a compiled prompt step
with the op gives the eager model's logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from buckets import BucketTable, GraphKey
from models import native
from models.compile import CompileSettings
from models.loading import load_model
from models.prepack import supported
from models.rms_norm import NATIVE_MIN_ROWS, NativeRMSNorm, eager_rms_norm, swap_rms_norms
from models.runner import ModelRunner, PrefillRow

needs_kernels = pytest.mark.skipif(not native.available(), reason="needs the native kernels (a C compiler)")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 64, 256, 1024])
@pytest.mark.parametrize("dim", [64, 576, 48])
def test_the_kernel_rounds_as_the_eager_formula(rows: int, dim: int) -> None:
    torch.manual_seed(rows * dim)
    x = (torch.randn(1, rows, dim) * 4).bfloat16()
    weight = (torch.randn(dim) * 0.3 + 1).bfloat16()
    got = native.rms_norm(x, weight, 1e-5)
    assert got is not None and got.shape == x.shape and got.dtype == torch.bfloat16
    want = eager_rms_norm(x, weight, 1e-5)
    # the kernel sums the squares in another order: the mean may differ in its last bit, an output by one step
    assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=0)


def test_the_op_declines_to_eager_where_the_kernel_does_not_take_the_inputs() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(40) + 1).bfloat16()
    odd = torch.randn(5, 40).bfloat16()  # 40 % 16 != 0
    strided = torch.randn(5, 128).bfloat16()[:, :64]  # not contiguous: the op copies it first
    assert native.rms_norm(odd, weight, 1e-6) is None
    assert torch.equal(torch.ops.bucketserve.rms_norm(odd, weight, 1e-6), eager_rms_norm(odd, weight, 1e-6))
    got = torch.ops.bucketserve.rms_norm(strided, weight[:1].expand(64).contiguous(), 1e-6)
    torch.testing.assert_close(got.float(), eager_rms_norm(strided, weight[:1].expand(64), 1e-6).float(),
                               rtol=1e-2, atol=0)
    native.configure(False)  # --no-native-kernels: the eager formula, exactly
    try:
        x, ones = torch.randn(70, 64).bfloat16(), torch.ones(64).bfloat16()
        assert torch.equal(torch.ops.bucketserve.rms_norm(x, ones, 1e-6), eager_rms_norm(x, ones, 1e-6))
    finally:
        native.configure(True)


class _OnePlusRMSNorm(nn.Module):
    """Gemma's variant, `(1 + weight)`: a different formula under a matching name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (1 + self.weight) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_only_llama_formula_norms_are_swapped(tiny_models: dict[str, str]) -> None:
    model = load_model(tiny_models["llama"], "bfloat16", "cpu")
    layers = model.config.num_hidden_layers
    assert swap_rms_norms(model) == 2 * layers + 1 and swap_rms_norms(model) == 0  # each layer's two and the last
    assert sum(type(m) is NativeRMSNorm for m in model.modules()) == 2 * layers + 1
    gemma_like = nn.Sequential(_OnePlusRMSNorm(64))  # the name matches, the formula does not
    assert swap_rms_norms(gemma_like) == 0
    assert swap_rms_norms(load_model(tiny_models["gpt2"], "bfloat16", "cpu")) == 0  # LayerNorm


@needs_kernels
@pytest.mark.skipif(not supported(torch.bfloat16, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")
def test_a_compiled_prompt_step_with_the_op_gives_the_eager_logits(tiny_llama: str, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    calls: list[int] = []
    real = native.rms_norm

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        calls.append(x.shape[-2])
        return real(x, weight, eps)

    monkeypatch.setattr(native, "rms_norm", counted)
    table = BucketTable(lengths=(8, NATIVE_MIN_ROWS), batch_sizes=(1,), prefill_batch_sizes=(1,),
                        context_length=2 * NATIVE_MIN_ROWS, kv_lengths=(2 * NATIVE_MIN_ROWS,))
    fp32 = ModelRunner(load_model(tiny_llama, "float32", "cpu"), table, CompileSettings(backend="inductor"))
    assert fp32.native_norms == 0  # float32 is never swapped: the reference path stays transformers'
    runner = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), table, CompileSettings(backend="inductor"))
    assert runner.native_norms > 0
    runner.warmup([GraphKey("prefill", 1, 8), GraphKey("prefill", 1, NATIVE_MIN_ROWS)])
    ids = [(7 * i) % 97 + 3 for i in range(NATIVE_MIN_ROWS - 3)]
    calls.clear()
    small = runner.prefill([PrefillRow(0, ids[:5])], 8, 1)
    assert calls == []  # 8 rows: inductor's own kernel, as before
    logits = runner.prefill([PrefillRow(0, ids)], NATIVE_MIN_ROWS, 1)
    assert len(calls) == runner.native_norms and set(calls) == {NATIVE_MIN_ROWS}
    eager = load_model(tiny_llama, "bfloat16", "cpu")
    with torch.no_grad():
        want = eager(torch.tensor([ids])).logits[0, -1].float()
        want_small = eager(torch.tensor([ids[:5]])).logits[0, -1].float()
    scale = float(want.abs().max())
    torch.testing.assert_close(logits[0].float(), want, rtol=0.05, atol=0.05 * scale)
    torch.testing.assert_close(small[0].float(), want_small, rtol=0.05, atol=0.05 * scale)
    assert runner.accountant.count("serving") == 0
