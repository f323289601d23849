"""Prepacked CPU linears (models/prepack.py): the same numbers as nn.Linear, the packed copy is what the
compiled step runs, and it lives exactly as long as its weight."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torch import nn

import models.module_swaps as module_swaps
import models.prepack as prepack_module
from buckets import BucketTable
from models import native, native_library, native_matmul
from models.compile import CompileSettings
from models.generator import generate_one
from models.loading import load_model
from models.prepack import PrepackedLinear, linear_cpu, packable_bytes, packed_count, packed_for, prepack, supported
from models.runner import ModelRunner
from models.sampling import SamplingParams

# oneDNN's bf16 reorder needs AVX-512 (or AVX-NE-CONVERT): the float32 tests still run on an AVX2-only CPU
needs_bf16 = pytest.mark.skipif(not supported(torch.bfloat16, "cpu"), reason="needs oneDNN's bf16 on the CPU")
needs_f32 = pytest.mark.skipif(not supported(torch.float32, "cpu"), reason="needs oneDNN (mkldnn) on the CPU")

TABLE = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=32,
                    kv_lengths=(16, 32))


@needs_bf16
def test_prepacked_model_gives_the_same_logits(tiny_llama: str) -> None:
    model = load_model(tiny_llama, "bfloat16", "cpu")
    ids = torch.tensor([random.Random(0).choices(range(5, 400), k=12)])
    with torch.no_grad():
        before = model(ids).logits
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        packed = prepack(model)
        after = model(ids).logits
    assert packed == len({m.weight.data_ptr() for m in linears}) > 0
    assert all(type(m) is PrepackedLinear for m in linears)
    alive = packed_count()
    assert prepack(model) == packed and packed_count() == alive  # again: nothing packed twice
    assert torch.equal(before, after)  # the same oneDNN kernel, only the weight's layout differs


@needs_bf16
def test_the_packed_copy_is_what_runs_and_is_dropped_with_its_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN on the packed copy, bit for bit: the small-row native matmul (which sums in another order) is off
    monkeypatch.setitem(native_library._switch, "on", False)
    torch.manual_seed(0)
    layer = nn.Linear(32, 48, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 1, 32, dtype=torch.bfloat16)
    expected = layer(x)
    gc.collect()  # models of earlier tests may still await collection: their packed copies would go below
    alive = packed_count()
    prepack(layer)
    assert packed_count() == alive + 1
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    # An unpacked weight of the same shape takes the plain path: the op never serves another weight's copy.
    other = torch.randn(48, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.bucketserve.linear(x, other, None), nn.functional.linear(x, other))
    del layer
    gc.collect()
    assert packed_count() == alive


@needs_bf16
def test_runner_prepacks_only_where_supported(tiny_llama: str) -> None:
    bf16 = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), TABLE, CompileSettings(backend="dynamo-eager"))
    assert bf16.prepacked > 0
    fp32 = ModelRunner(load_model(tiny_llama, "float32", "cpu"), TABLE, CompileSettings(backend="dynamo-eager"))
    assert fp32.prepacked > 0 and fp32.fused_mlps == 0 and fp32.native_norms == 0
    off = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), TABLE,
                      CompileSettings(backend="dynamo-eager", weight_prepack=False))
    assert off.prepacked == 0
    frozen = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), TABLE,
                         CompileSettings(backend="inductor", inductor_freezing=True))
    assert frozen.prepacked == 0  # freezing packs inside the graph


@needs_bf16
def test_compiled_steps_run_the_packed_weights_and_match_plain_ones(tiny_llama: str) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ids = random.Random(4).choices(range(5, 400), k=11)
    outputs = []
    for flag in (True, False):
        model = load_model(tiny_llama, "bfloat16", "cpu")
        runner = ModelRunner(model, TABLE, CompileSettings(backend="dynamo-eager", weight_prepack=flag))
        runner.warmup()
        outputs.append(generate_one(runner, ids, params, 16).token_ids)
        assert runner.accountant.count("serving") == 0
        if flag:
            # Poison the packed copies of the output head: the traced step must now produce zero logits.
            from models import prepack as module

            head = model.get_output_embeddings().weight
            zeros = torch.zeros_like(head)  # alive until the step below: the native kernels read its copies
            poisoned = module._packed(zeros, torch.ops.mkldnn._reorder_linear_weight(zeros), "none")
            with module._LOCK:  # the Python kernels' table and the C++ ones' (where installed)
                module._PACKED[head.data_ptr()] = poisoned
                module._mirror(head.data_ptr(), poisoned)
            logits = runner.decode(1, torch.tensor([7]), torch.tensor([11]))
            assert torch.count_nonzero(logits[0]) == 0
        runner.stop_serving()
    assert outputs[0] == outputs[1]


@needs_f32
def test_float32_takes_the_vector_kernel_for_its_rows_mkl_with_kernels_off_and_onednn_for_more(
        tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: 1 to tiled_f32_rows() rows (32 with AVX-512, 128 with AVX2 only) take the native fp32 vector matmul
    on the fp32 tile copy (sums in another order: equal within fp32 rounding), but one row on an AMX CPU the
    one-row matmul on the plain weight; with the kernels off one row takes MKL's plain matmul (bit for bit the
    reference's); more rows (and 2-32 with the kernels off) read oneDNN's packed copy (equal within fp32 rounding),
    or MKL's plain matmul on AVX2-only CPUs (native.f32_mkl_rows)."""
    model = load_model(tiny_llama, "float32", "cpu")
    assert prepack(model) > 0
    layer = next(m for m in model.modules() if isinstance(m, PrepackedLinear))
    w = layer.weight.detach()
    kernel_rows = native_matmul.tiled_f32_rows() if native.available() and native.has("f32") else 32
    one, rows, many = (torch.randn(n, w.shape[1]) for n in (1, 8, kernel_rows + 1))
    kernel_calls: list[tuple[int, int]] = []  # (kind, rows)
    real_packed = prepack_module.packed_linear

    def counted(x: torch.Tensor, kernel: native_matmul.Kernel, n: int) -> torch.Tensor | None:
        out = real_packed(x, kernel, n)
        if out is not None:
            kernel_calls.append((kernel[0], x.shape[0]))
        return out

    onednn_calls: list[int] = []
    real_onednn = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        onednn_calls.append(x.shape[0])
        return real_onednn(x, *args)

    monkeypatch.setattr(prepack_module, "packed_linear", counted)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for x in (one, rows, many):  # the op's Python kernel (its C++ one chooses alike: test_native_dispatch.py)
        torch.testing.assert_close(linear_cpu(x, w, layer.bias), nn.functional.linear(x, w, layer.bias), rtol=1e-5,
                                   atol=1e-5)
    if native.available() and native.has("f32"):
        first = native_matmul.ONE_ROW_F32 if native_matmul.amx_available() else native_matmul.TILED_F32
        past = [] if native.f32_mkl_rows() else [kernel_rows + 1]  # past the kernel: MKL's (AVX2 only) or oneDNN's
        assert kernel_calls == [(first, 1), (native_matmul.TILED_F32, 8)] and onednn_calls == past
        if native.f32_mkl_rows():  # MKL's own bits, through the op too (its C++ kernel where installed)
            assert torch.equal(linear_cpu(many, w, layer.bias), nn.functional.linear(many, w, layer.bias))
            assert torch.equal(layer(many), nn.functional.linear(many, w, layer.bias))
    entry = prepack_module.packed_for(w, rows)
    assert entry is not None
    unread = prepack_module.onednn_unread(torch.float32) and native_matmul.f32_tiles_take(w)  # asked with kernels on
    monkeypatch.setitem(native_library._switch, "on", False)
    kernel_calls.clear()
    onednn_calls.clear()
    assert torch.equal(linear_cpu(one, w, None), nn.functional.linear(one, w))
    linear_cpu(rows, w, None)
    assert kernel_calls == [] and onednn_calls == [8]  # kernels off: MKL's matmul for one row, oneDNN for more
    # where no step reads oneDNN's copy with the kernels on (AVX2 builds), none was made: oneDNN took the plain
    # weight just now, as it does on the reordered copy elsewhere
    assert (not entry.onednn.is_mkldnn and entry.onednn.data_ptr() == w.data_ptr()) == unread
    torch.testing.assert_close(linear_cpu(rows, w, None), nn.functional.linear(rows, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_tile_copies_are_left_out_where_memory_is_short(tiny_llama: str, dtype: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner makes oneDNN's copy and the tile copy only where each leaves MEMORY_RESERVE free (the KV cache
    already allocated); without the tile copy small steps take oneDNN (or the plain weight) and give the same
    logits within the kernels' rounding; without room for either the linears stay plain."""
    if not supported(getattr(torch, dtype), "cpu"):
        pytest.skip(f"needs oneDNN's {dtype} on the CPU")
    weights = packable_bytes(load_model(tiny_llama, dtype, "cpu"))
    reserve = module_swaps.MEMORY_RESERVE
    for free, copies in ((2 * weights + reserve, 2), (2 * weights + reserve - 1, 1), (weights + reserve - 1, 0)):
        monkeypatch.setattr(module_swaps, "available_memory", lambda free=free: free)
        model = load_model(tiny_llama, dtype, "cpu")
        runner = ModelRunner(model, TABLE, CompileSettings(backend="dynamo-eager"))
        linear = next((m for m in model.modules() if isinstance(m, PrepackedLinear)), None)
        assert (runner.prepacked > 0) == (copies > 0) and (linear is not None) == (copies > 0)
        if linear is None:
            continue
        x = torch.randn(8, linear.weight.shape[1], dtype=linear.weight.dtype)
        packed = packed_for(linear.weight.detach(), x)
        assert packed is not None
        tiled = native.has("f32") if dtype == "float32" else native.has("matmul")  # the fp32 or the bf16 kernel
        assert (packed.tiles is not None) == (copies == 2 and native.available() and tiled)
        if copies == 1:
            assert packed.kernel(8) is None  # oneDNN's packed copy
        atol = 2e-2 if dtype == "bfloat16" else 1e-5
        torch.testing.assert_close(linear(x), nn.functional.linear(x, linear.weight), rtol=atol, atol=atol)

