"""Weight-only int8 (`--quantize int8`, models/native_matmul.py int8_pack / int8_matmul, routed by models/prepack.py):
the packed copy holds each weight's rounding to its column's int8 grid, the int8 kernel (AMX's, or the vector one
without AMX) equals a float32 matmul of that dequantized weight, steps of 1-128 rows read it and larger ones keep
oneDNN's bf16, and a quantized runner serves with logits close to bf16's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from buckets import BucketTable
from models import native_library, native_matmul
from models.compile import CompileSettings
from models.generator import generate_one
from models.loading import load_model
from models.prepack import linear_cpu, prepack
from models.runner import ModelRunner
from models.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _int8_kernel() -> None:
    if not native_matmul.int8_kind():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU: no int8 kernel")


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed int8 copy [N/32, K/32, 2, 16, 16, 2] back to [N, K] float32 weights."""
    n, k = q.shape[0] * 32, q.shape[1] * 32
    return q.permute(0, 2, 4, 1, 3, 5).reshape(n, k).float() * scale[:, None]


def test_int8_pack_rounds_each_weight_to_its_columns_grid() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96).bfloat16()
    w[5] = 0  # a zero column: scale stays positive, q stays 0
    packed = native_matmul.int8_pack(w)
    assert packed is not None
    q, scale = packed
    assert q.dtype == torch.int8 and q.shape == (2, 3, 2, 16, 16, 2) and scale.shape == (64,)
    assert int(q.abs().max()) == 127
    torch.testing.assert_close(scale[:5], w[:5].float().abs().amax(dim=1) / 127)
    for g, b, j, r, n, i in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 15, 1), (0, 1, 1, 3, 7, 0), (1, 0, 0, 9, 2, 1)]:
        row, col = 32 * g + 16 * j + n, 32 * b + 2 * r + i
        assert int(q[g, b, j, r, n, i]) == round(float(w[row, col]) / float(scale[row]))
    err = (_dequantized(q, scale) - w.float()).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())
    assert not _dequantized(q, scale)[5].any()


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 33, 128])
def test_int8_matmul_equals_a_float32_matmul_of_the_dequantized_weight(rows: int, out_features: int,
                                                                        in_features: int, threads: int) -> None:
    torch.manual_seed(rows + out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * in_features ** -0.5).bfloat16()
    packed = native_matmul.int8_pack(w)
    assert packed is not None
    want = x.float() @ _dequantized(*packed).T
    got = native_matmul.int8_matmul(x, *packed)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # one bf16 rounding of fp32 sums
    bias = torch.randn(out_features).bfloat16()
    with_bias = native_matmul.int8_matmul(x, *packed, bias)
    assert with_bias is not None
    torch.testing.assert_close(with_bias.float(), want + bias.float(), rtol=1e-2, atol=2e-2)


def test_int8_matmul_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    packed = native_matmul.int8_pack(torch.randn(96, 64).bfloat16())
    assert packed is not None
    q, scale = packed
    assert native_matmul.int8_matmul(torch.randn(129, 64).bfloat16(), q, scale) is None  # a prompt: oneDNN's
    assert native_matmul.int8_matmul(torch.randn(4, 64), q, scale) is None  # float32 input
    assert native_matmul.int8_matmul(torch.randn(4, 32).bfloat16(), q, scale) is None  # K does not match
    assert native_matmul.int8_matmul(torch.randn(4, 64).bfloat16(), q, scale[:32]) is None  # a scale per column
    assert native_matmul.int8_pack(torch.randn(48, 64).bfloat16()) is None  # N % 32
    assert native_matmul.int8_pack(torch.randn(96, 64)) is None  # float32 weights are never quantized
    monkeypatch.setitem(native_library._switch, "on", False)
    assert native_matmul.int8_matmul(torch.randn(4, 64).bfloat16(), q, scale) is None  # --no-native-kernels


def test_quantized_linears_route_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """1-128 rows read the int8 copy (its result: the dequantized weight's); more rows run oneDNN on the bf16
    weight (the plain linear's result)."""
    torch.manual_seed(5)
    layer = torch.nn.Linear(64, 96, bias=True).bfloat16().requires_grad_(False)
    with pytest.raises(ValueError, match="quantize"):
        prepack(layer, "int4")
    prepack(layer, "int8")
    from models.prepack import _PACKED

    entry = _PACKED[layer.weight.data_ptr()]
    assert entry.int8 is not None and entry.tiles is None  # the int8 copy replaces the bf16 tile copy
    deq = _dequantized(*entry.int8)
    taken: list[int] = []
    real = native_matmul.packed_linear

    def counted(x: torch.Tensor, kernel: native_matmul.Kernel, n: int) -> torch.Tensor | None:
        out = real(x, kernel, n)
        if out is not None and kernel[0] == native_matmul.int8_kind():
            taken.append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr("models.prepack.packed_linear", counted)
    for rows in (1, 4, 128, 129):
        x = torch.randn(rows, 1, 64).bfloat16()
        if rows <= 128:
            want = x.float() @ deq.T + layer.bias.float()
        else:
            want = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
        torch.testing.assert_close(linear_cpu(x, layer.weight, layer.bias).float(), want, rtol=1e-2, atol=2e-2)
    assert taken == [1, 4, 128]  # (the op's Python kernel; the C++ one chooses as it does: test_native_dispatch.py)


def test_a_quantized_runner_serves_close_to_bf16(tiny_llama: str) -> None:
    """The tiny model's lm_head (vocab 420) is not a multiple of 32 and keeps bf16; its layers go int8."""
    table = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=32,
                        kv_lengths=(32,))
    ids = [11, 23, 35, 47, 59, 71, 83]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    logits = {}
    for mode in ("none", "int8"):
        model = load_model(tiny_llama, "bfloat16", "cpu")
        runner = ModelRunner(model, table, CompileSettings(backend="inductor", quantize=mode))
        runner.warmup()
        out = generate_one(runner, ids, params, 16)
        assert len(out.token_ids) == 6 and runner.accountant.count("serving") == 0
        logits[mode] = runner.decode(1, torch.tensor([out.token_ids[0]]), torch.tensor([len(ids)]))[0].float()
        runner.stop_serving()
    span = float(logits["none"].abs().max())
    assert float((logits["int8"] - logits["none"]).abs().max()) < 0.05 * span
    assert not torch.equal(logits["int8"], logits["none"])  # the int8 weights were read


def test_int8_refuses_float32() -> None:
    with pytest.raises(ValueError, match="quantize"):
        CompileSettings(quantize="int4")
