"""RMSNorm as one C call for prompt-sized bf16 steps (models/rms_norm.py): the op rounds as transformers' eager
bf16 RMSNorm rounds, only Llama-formula norms of prepacked bf16 runners are swapped, and a compiled prompt step
with the op gives the eager model's logits."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

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
@pytest.mark.parametrize("rows", [1, 3, 64, 257, 1024])
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


@needs_kernels
def test_the_kernel_splits_rows_over_threads_with_the_same_result() -> None:
    torch.manual_seed(1)
    x, weight = torch.randn(300, 576).bfloat16(), (torch.randn(576) + 1).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rms_norm(x, weight, 1e-6)
        torch.set_num_threads(2)
        two = native.rms_norm(x, weight, 1e-6)
    finally:
        torch.set_num_threads(before)
    assert one is not None and two is not None and torch.equal(one, two)
    empty = native.rms_norm(x[:0], weight, 1e-6)  # no rows: nothing to do
    assert empty is not None and empty.shape == (0, 576)


def test_the_op_declines_to_eager_where_the_kernel_does_not_take_the_inputs() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(40) + 1).bfloat16()
    odd = torch.randn(5, 40).bfloat16()  # 40 % 16 != 0
    strided = torch.randn(5, 128).bfloat16()[:, :64]  # not contiguous: the op copies it first
    assert native.rms_norm(odd, weight, 1e-6) is None
    assert torch.equal(torch.ops.bucketserve.rms_norm(odd, weight, 1e-6), eager_rms_norm(odd, weight, 1e-6))
    w64 = (torch.randn(64) + 1).bfloat16()
    got = torch.ops.bucketserve.rms_norm(strided, w64, 1e-6)
    assert got.is_contiguous()  # as the op's fake declares
    torch.testing.assert_close(got.float(), eager_rms_norm(strided, w64, 1e-6).float(), rtol=1e-2, atol=0)
    was = native.enabled()
    native.configure(False)  # --no-native-kernels: the eager formula, exactly
    try:
        x, ones = torch.randn(70, 64).bfloat16(), torch.ones(64).bfloat16()
        assert torch.equal(torch.ops.bucketserve.rms_norm(x, ones, 1e-6), eager_rms_norm(x, ones, 1e-6))
    finally:
        native.configure(was)


class _OnePlusRMSNorm(nn.Module):
    """Gemma's variant, `(1 + weight)`: a different formula under a matching name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.bfloat16))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * h.to(x.dtype)


class _OnceRoundedRMSNorm(_OnePlusRMSNorm):
    """OLMo-2's variant, `(weight * h).to(bf16)`: the Llama formula with one rounding instead of two."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


def _holder(norm: nn.Module, hidden_size: int) -> nn.Module:
    holder = nn.Sequential(norm)
    holder.config = SimpleNamespace(hidden_size=hidden_size)  # type: ignore[assignment]
    return holder


def test_only_hidden_size_llama_formula_norms_of_bf16_and_fp32_models_are_swapped(tiny_models: dict[str, str]
                                                                                   ) -> None:
    model = load_model(tiny_models["llama"], "bfloat16", "cpu")
    layers = model.config.num_hidden_layers
    assert swap_rms_norms(model) == 2 * layers + 1 and swap_rms_norms(model) == 0  # each layer's two and the last
    assert sum(type(m) is NativeRMSNorm for m in model.modules()) == 2 * layers + 1
    for variant in (_OnePlusRMSNorm, _OnceRoundedRMSNorm):  # the names match, the formulas do not
        norm = variant(64)
        norm.weight.data.normal_(1.0, 0.3)
        assert swap_rms_norms(_holder(norm, 64)) == 0, variant.__name__
    llama_norm = type(load_model(tiny_models["llama"], "bfloat16", "cpu").model.norm)(64, eps=1e-6).bfloat16()
    assert swap_rms_norms(_holder(llama_norm, 128)) == 0  # not over the hidden size (a per-head norm)
    # float32: swapped too (the fused layers need it); its op is a plain loop, the formula at decode sizes
    assert swap_rms_norms(load_model(tiny_models["llama"], "float32", "cpu")) == 2 * layers + 1
    assert swap_rms_norms(load_model(tiny_models["gpt2"], "bfloat16", "cpu")) == 0  # LayerNorm


@needs_kernels
@pytest.mark.skipif(not supported(torch.bfloat16, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")
def test_a_compiled_prompt_step_with_the_op_gives_the_eager_logits(tiny_llama: str) -> None:
    def norm_calls(step: Callable[[], torch.Tensor]) -> tuple[list[int], torch.Tensor]:
        """The rows of each bucketserve::rms_norm call the step makes (the op's kernel is C++ or Python), and its
        result."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            out = step()
        return [e.input_shapes[0][-2] for e in prof.events() if e.name == "bucketserve::rms_norm"], out

    table = BucketTable(lengths=(8, NATIVE_MIN_ROWS), batch_sizes=(1,), prefill_batch_sizes=(1,),
                        context_length=2 * NATIVE_MIN_ROWS, kv_lengths=(2 * NATIVE_MIN_ROWS,))
    fp32 = ModelRunner(load_model(tiny_llama, "float32", "cpu"), table, CompileSettings(backend="inductor"))
    assert fp32.native_norms == 0  # float32 is never swapped: the reference path stays transformers'
    off = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), table,
                      CompileSettings(backend="inductor", native_kernels=False))
    assert off.native_norms == 0  # --no-native-kernels: inductor's fused kernels, as before
    runner = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), table, CompileSettings(backend="inductor"))
    assert runner.native_norms > 0
    runner.warmup([GraphKey("prefill", 1, 8), GraphKey("prefill", 1, NATIVE_MIN_ROWS)])
    ids = [(7 * i) % 97 + 3 for i in range(NATIVE_MIN_ROWS - 3)]
    calls, small = norm_calls(lambda: runner.prefill([PrefillRow(0, ids[:5])], 8, 1))
    assert calls == []  # 8 rows: inductor's own kernel, as before
    calls, logits = norm_calls(lambda: runner.prefill([PrefillRow(0, ids)], NATIVE_MIN_ROWS, 1))
    assert len(calls) == runner.native_norms and set(calls) == {NATIVE_MIN_ROWS}
    eager = load_model(tiny_llama, "bfloat16", "cpu")
    with torch.no_grad():
        want = eager(torch.tensor([ids])).logits[0, -1].float()
        want_small = eager(torch.tensor([ids[:5]])).logits[0, -1].float()
    scale = float(want.abs().max())
    torch.testing.assert_close(logits[0].float(), want, rtol=0.05, atol=0.05 * scale)
    torch.testing.assert_close(small[0].float(), want_small, rtol=0.05, atol=0.05 * scale)
    assert runner.accountant.count("serving") == 0
