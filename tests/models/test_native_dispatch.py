"""The C++ kernels of bucketserve::linear, gated_silu, attention and rms_norm (models/native_dispatch.py) give the
Python kernels' bits: the same choice of native kernel, oneDNN or the plain matmul for every step size, dtype, bias
and switch state."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable

import pytest
import torch
from torch import nn

from models import native, native_dispatch, native_library, native_matmul
from models import prepack as prepack_module
from models.gated_mlp import _gated_cpu
from models.prepack import dispatch_natively, linear_cpu, packed_count, prepack

needs_kernels = pytest.mark.skipif(not native.available() or shutil.which("g++") is None and shutil.which("c++") is None,
                                   reason="needs the native kernels and a C++ compiler")


@pytest.fixture(scope="module")
def installed() -> None:
    assert dispatch_natively(), "the C++ op kernels did not build or install"
    assert native_dispatch.installed()
    for op in native_dispatch.KERNELS:  # the CPU kernel the dispatcher holds is the C++ one
        assert "dispatch.cpp" in next(line for line in torch._C._dispatch_dump(f"bucketserve::{op}").splitlines()
                                      if line.startswith("CPU:"))


def _layer(n: int, k: int, dtype: torch.dtype, bias: bool, seed: int, quantize: str = "none") -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    prepack(layer, quantize)
    return layer


ROWS = (1, 2, 8, 33, 128, 129, 300)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("quantize", ["none", "int8"])
@pytest.mark.parametrize("n", [96, 48])  # 48: no tile copy (N % 32), the small matmul's weight
def test_linear_gives_the_python_kernels_bits(installed: None, dtype: torch.dtype, bias: bool, on: bool, n: int,
                                              quantize: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if quantize == "int8" and (dtype != torch.bfloat16 or n % 32 or not native_matmul.int8_kind()):
        pytest.skip("int8 copies: bf16 weights whose N is a multiple of 32, on AMX or AVX512-BF16")
    layer = _layer(n, 64, dtype, bias, seed=1, quantize=quantize)
    monkeypatch.setitem(native_library._switch, "on", on)  # after packing: int8 copies need the kernels
    for rows in ROWS:
        x = torch.randn(rows, 64, dtype=dtype)
        for shaped in (x, x.view(1, rows, 64), x.t().contiguous().t()):  # 3-D, and not contiguous
            got = torch.ops.bucketserve.linear(shaped, layer.weight, layer.bias)
            assert got.shape == (*shaped.shape[:-1], n)
            assert torch.equal(got, linear_cpu(shaped, layer.weight, layer.bias)), (rows, shaped.shape)


@needs_kernels
def test_a_weight_it_does_not_know_takes_the_plain_matmul(installed: None) -> None:
    layer = _layer(48, 32, torch.bfloat16, False, seed=2)
    other = torch.randn(48, 32, dtype=torch.bfloat16)  # same shape, never packed
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.bucketserve.linear(x, other, None), nn.functional.linear(x, other))
    # another dtype than the packed weight's: the plain matmul too
    wide = layer.weight.float()
    assert torch.equal(torch.ops.bucketserve.linear(x.float(), wide, None), nn.functional.linear(x.float(), wide))


@needs_kernels
@pytest.mark.parametrize("on", [True, False])
def test_gated_silu_gives_the_python_kernels_bits(installed: None, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(native_library._switch, "on", on)
    gate, up = _layer(128, 64, torch.bfloat16, False, seed=3), _layer(128, 64, torch.bfloat16, False, seed=4)
    for rows in ROWS:
        x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
        got = torch.ops.bucketserve.gated_silu(x, gate.weight, None, up.weight, None)
        assert got.shape == (1, rows, 128)
        assert torch.equal(got, _gated_cpu(x, gate.weight, None, up.weight, None)), rows
    biased_gate, biased_up = _layer(128, 64, torch.bfloat16, True, 5), _layer(128, 64, torch.bfloat16, True, 6)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    args = (x, biased_gate.weight, biased_gate.bias, biased_up.weight, biased_up.bias)
    assert torch.equal(torch.ops.bucketserve.gated_silu(*args), _gated_cpu(*args))


ROWS_APART = (native_matmul.AMX, native_matmul.AMX_INT8, native_matmul.TILED, native_matmul.TILED_F32,
              native_matmul.TILED_INT8)  # dispatch.cpp's rows_apart


def _zeroed(x: torch.Tensor, pattern: str) -> torch.Tensor:
    """x [rows, K] with some rows zeroed: the live rows leading (a decode batch's low slots busy), scattered (free
    slots between busy ones; -0.0 counts as zero too), or none live."""
    x = x.clone()
    rows = x.shape[0]
    if pattern == "leading":
        x[rows // 2:] = 0
    elif pattern == "scattered":
        x[1::3] = 0
        x[2::5] = -0.0
    else:
        x[:] = 0
    return x


@needs_kernels
@pytest.mark.parametrize("dtype,quantize", [(torch.bfloat16, "none"), (torch.float32, "none"),
                                            (torch.bfloat16, "int8")])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("pattern", ["leading", "scattered", "none live"])
def test_zero_rows_skip_the_kernel_and_the_other_rows_keep_their_bits(
        installed: None, dtype: torch.dtype, quantize: str, bias: bool, pattern: str) -> None:
    """The C++ linear and gated MLP run only the rows that are not all zeros where the kernel sums rows apart (the
    tiled and AMX kernels): the zero rows come out as zeros (plus the bias), the others with the bits of the whole call.
    Proof that the zero rows did not run: the weight holds an infinity, whose product with a computed zero is NaN."""
    if quantize == "int8" and not native_matmul.int8_kind():
        pytest.skip("int8 copies need AMX or AVX512-BF16")
    if not prepack_module.supported(dtype, "cpu"):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    n, k = 96, 64
    layer = _layer(n, k, dtype, bias, seed=11, quantize=quantize)
    for rows in (2, 5, 16, 32):
        packed = prepack_module.packed_for(layer.weight, torch.empty(rows, k, dtype=dtype))
        kernel = packed.kernel(rows) if packed is not None else None
        if kernel is None or kernel[0] not in ROWS_APART:
            continue  # oneDNN or a one-row kernel: every row runs, as before
        x = _zeroed(torch.randn(rows, k, dtype=dtype), pattern)
        zero = (x == 0).all(dim=1)
        got = torch.ops.bucketserve.linear(x, layer.weight, layer.bias)
        assert torch.equal(got, linear_cpu(x, layer.weight, layer.bias)), (rows, pattern)
        # the same kernel on the live rows alone (linear_cpu could pick another for one row: fp32 on AMX CPUs)
        alone = native_matmul.packed_linear(x[~zero].contiguous(), kernel, n)
        assert alone is not None or not (~zero).any()
        if alone is not None:
            assert torch.equal(got[~zero], alone if layer.bias is None else alone.add_(layer.bias)), (rows, pattern)
        if dtype == torch.bfloat16 and not bias:
            gate, up = _layer(128, k, dtype, False, 12, quantize), _layer(128, k, dtype, False, 13, quantize)
            got = torch.ops.bucketserve.gated_silu(x, gate.weight, None, up.weight, None)
            assert torch.equal(got[zero], torch.zeros_like(got[zero]))
            assert torch.equal(got[~zero], _gated_cpu(x[~zero], gate.weight, None, up.weight, None)), rows
    torch.manual_seed(14)
    poisoned = nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)
    with torch.no_grad():
        poisoned.weight[5, 3] = float("inf")
    prepack(poisoned, quantize if dtype == torch.bfloat16 else "none")
    x = _zeroed(torch.randn(16, k, dtype=dtype), pattern)
    zero = (x == 0).all(dim=1)
    kernel = prepack_module.packed_for(poisoned.weight, x).kernel(16)  # type: ignore[union-attr]
    if kernel is None or kernel[0] not in ROWS_APART:
        pytest.skip("16 rows do not take a tiled or AMX kernel here")
    got = torch.ops.bucketserve.linear(x, poisoned.weight, poisoned.bias)
    expected = poisoned.bias.expand(int(zero.sum()), n) if bias else torch.zeros(int(zero.sum()), n, dtype=dtype)
    assert torch.equal(got[zero], expected)  # computed, column 5 would be NaN (0 * inf)
    if pattern != "none live":  # the live rows did run
        assert got[~zero][:, 5].isnan().any() or got[~zero][:, 5].isinf().all()
    if dtype == torch.bfloat16 and not bias:
        torch.manual_seed(15)
        gate, up = (nn.Linear(k, 128, bias=False).to(dtype).requires_grad_(False) for _ in range(2))
        with torch.no_grad():
            gate.weight[7, 3] = float("inf")
            up.weight[7, 3] = float("inf")
        prepack(gate, quantize)
        prepack(up, quantize)
        got = torch.ops.bucketserve.gated_silu(x, gate.weight, None, up.weight, None)
        assert torch.equal(got[zero], torch.zeros_like(got[zero]))  # computed: column 7 NaN


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_call_past_the_kernels_rows_runs_its_few_live_rows_on_the_kernel(installed: None, dtype: torch.dtype) -> None:
    """A verify graph's lm_head: more rows than the vector kernels take (fp32: 64 against 32), most of them zeros or
    repeats of the row before (its padding logit rows: runner.py). Its live rows run on the kernel (the bits of that
    kernel on them alone), a repeat gets its row before's output, and the zero rows are not run at all (the weight's
    infinity would make a computed zero row NaN); with more live rows than the kernel takes, oneDNN as before."""
    if not prepack_module.supported(dtype, "cpu"):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    n, k = 96, 64
    torch.manual_seed(16)
    layer = nn.Linear(k, n, bias=False).to(dtype).requires_grad_(False)
    with torch.no_grad():
        layer.weight[5, 3] = float("inf")
    prepack(layer, "none")
    entry = prepack_module.packed_for(layer.weight, torch.empty(1, k, dtype=dtype))
    if entry is None or entry.few is None or entry.few[0] not in ROWS_APART or entry.few_max > 256:
        pytest.skip("no bounded row-apart kernel for this dtype here")
    rows = 2 * entry.few_max
    for live in ([0], [3, 17, 40, rows - 1], list(range(1, rows, 2))[: entry.few_max]):
        x = torch.zeros(rows, k, dtype=dtype)
        x[live] = torch.randn(len(live), k, dtype=dtype)
        got = torch.ops.bucketserve.linear(x, layer.weight, None)
        kernel = entry.kernel(len(live))
        assert kernel is not None
        alone = native_matmul.packed_linear(x[live].contiguous(), kernel, n)
        assert alone is not None and torch.equal(got[live], alone), live
        dead = torch.ones(rows, dtype=torch.bool)
        dead[live] = False
        assert torch.equal(got[dead], torch.zeros_like(got[dead])), live  # not run: column 5 would be NaN
        if len(live) > 4:
            continue
        # the padding rows as runs of one live row's copies (a verify step whose drafts fill its token bucket)
        x[dead] = x[live[0]].clone()
        got = torch.ops.bucketserve.linear(x, layer.weight, None)
        for r in range(rows):
            pair = native_matmul.packed_linear(x[[r, r]].contiguous(), entry.few, n)
            assert pair is not None and torch.equal(got[r], pair[0]), (live, r)
    x = torch.randn(rows, k, dtype=dtype)
    x[::4] = 0  # 3/4 live: more than the kernel takes
    got = torch.ops.bucketserve.linear(x, layer.weight, None)
    assert got[::4, 5].isnan().all()  # oneDNN ran every row, the zero ones too


@needs_kernels
def test_a_freed_weight_is_forgotten_and_a_new_one_packed_later_is_known(installed: None) -> None:
    gc.collect()
    before = native_dispatch.remembered()
    assert before == packed_count()  # every packed weight mirrored, those packed before the install too
    dtype = torch.bfloat16 if prepack_module.supported(torch.bfloat16, "cpu") else torch.float32
    layer = _layer(32, 32, dtype, False, seed=7)
    assert native_dispatch.remembered() == before + 1
    x = torch.randn(2, 32, dtype=dtype)
    assert torch.equal(torch.ops.bucketserve.linear(x, layer.weight, None), linear_cpu(x, layer.weight, None))
    del layer
    gc.collect()
    assert native_dispatch.remembered() == before


def _mask(extents: list[int], positions: int, dtype: torch.dtype, queries: int = 1, window: int = 0) -> torch.Tensor:
    """[rows, 1, queries, positions] additive: row r attends [0, extents[r]) (with a window: its last `window`)."""
    pos = torch.arange(positions)[None]
    ext = torch.tensor(extents)[:, None]
    seen = (pos < ext) & (pos >= ext - window) if window else pos < ext
    mask = torch.where(seen, 0.0, float("-inf")).to(dtype).view(len(extents), 1, 1, positions)
    return mask.expand(-1, -1, queries, -1).contiguous()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on", [True, False])
def test_attention_gives_the_python_kernels_bits(installed: None, dtype: torch.dtype, on: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode with heads packed (the one-call path; also over a KV bucket's view of the slot buffers), and what it
    declines to the Python rest (`attention_general`): a sliding window, grouped heads unpacked, several queries."""
    from models.attention import _attention_cpu

    monkeypatch.setitem(native_library._switch, "on", on)
    torch.manual_seed(8)
    kv, groups, dim, positions, scale = 2, 3, 64, 64, 64 ** -0.5
    k = torch.randn(4, kv, positions, dim).to(dtype)
    v = torch.randn(4, kv, positions, dim).to(dtype)
    packed = torch.randn(4, kv, groups, dim).to(dtype)
    extents = [3, 40, 17, 64]
    cases = {
        "decode": (packed, k, v, _mask(extents, positions, dtype)),
        "kv bucket": (packed[:3], k[:, :, :32], v[:, :, :32], _mask([5, 32, 17], 32, dtype)),
        "window": (packed, k, v, _mask(extents, positions, dtype, window=8)),
        "grouped": (torch.randn(4, kv * groups, 1, dim).to(dtype), k, v, _mask(extents, positions, dtype)),
        "queries": (torch.randn(4, kv, 4, dim).to(dtype), k, v, _mask(extents, positions, dtype, queries=4)),
    }
    import models.attention as attention_module

    general: list[str] = []  # the cases the C++ kernel handed to the Python rest (which scans the mask first)
    real_extents = attention_module._extents

    def watched(mask: torch.Tensor) -> tuple[tuple[int, ...], bool]:
        general.append(current)
        return real_extents(mask)

    monkeypatch.setattr(attention_module, "_extents", watched)
    for current, (q, key, value, mask) in cases.items():
        got = torch.ops.bucketserve.attention(q, key, value, mask, scale)
        assert torch.equal(got, _attention_cpu(q, key, value, mask, scale)), current
    # both kernels ran (C++ first), so each general case shows up twice; the one-call cases only for Python's own
    # declines (switched off, or a build whose decode kernel loses to SDPA: native.decode_kernel)
    one_call = [] if on and native.decode_kernel(dtype) else ["decode", "decode", "kv bucket", "kv bucket"]
    assert sorted(general) == sorted(one_call + ["window"] * 2 + ["grouped"] * 2 + ["queries"] * 2)


@needs_kernels
@pytest.mark.parametrize("on", [True, False])
def test_rms_norm_gives_the_python_kernels_bits(installed: None, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rows through rms_norm.c (a step's norms, any row count; a view that is not contiguous), and what it
    declines to the eager formula: float32 rows, a weight of another size, the kernels switched off."""
    from models.rms_norm import _rms_cpu

    monkeypatch.setitem(native_library._switch, "on", on)
    torch.manual_seed(9)
    weight = torch.randn(576).bfloat16()
    cases = {
        "rows": (torch.randn(1, 128, 576).bfloat16() * 3, weight),
        "one row": (torch.randn(1, 1, 576).bfloat16(), weight),
        "view": (torch.randn(96, 1152).bfloat16()[:, :576], weight),
        "float32": (torch.randn(64, 576), weight),
        "other size": (torch.randn(64, 40).bfloat16(), torch.randn(40).bfloat16()),  # rms_norm.c: D % 16 == 0
    }
    for name, (x, w) in cases.items():
        got, ops = _profiled(lambda x=x, w=w: torch.ops.bucketserve.rms_norm(x, w, 1e-5))
        want = _rms_cpu(x, w, 1e-5)
        assert got.is_contiguous() and got.dtype == want.dtype and torch.equal(got, want), name
        kernel = on and name in ("rows", "one row", "view")  # else the eager formula (its mean is an aten op)
        assert ("aten::mean" not in ops) == kernel, name


def _profiled(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, set[str]]:
    """call()'s result and the names of the ops it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = call()
    return out, {e.name for e in prof.events()}


def _meta(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on", [True, False])
def test_mixed_attention_gives_the_python_kernels_bits(installed: None, dtype: torch.dtype, on: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed steps: decoding runs of consecutive slots, prompt pieces from position 0 and from further on (the piece
    kernel's, or SDPA's called from C++ where there is no piece kernel), padding tokens (the spare slot), a query
    that is a view (the graph's transpose), and what the C++ path hands to the Python kernel whole (a head size the
    kernels do not take, float16)."""
    from models.mixed_attention import _mixed_attention_cpu

    monkeypatch.setitem(native_library._switch, "on", on)
    torch.manual_seed(10)
    kv, groups, dim, context, slots = 2, 3, 64, 96, 5  # slot 5: the spare slot
    k = torch.randn(slots + 1, kv, context, dim).to(dtype)
    v = torch.randn(slots + 1, kv, context, dim).to(dtype)
    steps = {
        "rows then piece": [(0, 20), (1, 33), (2, 7), *((3, p) for p in range(40, 58)), (5, 0), (5, 0)],
        "piece then rows": [*((4, p) for p in range(0, 17)), (0, 90), (1, 5), (3, 60)],
        "two pieces": [*((0, p) for p in range(3)), (2, 10), *((1, p) for p in range(30, 62))],
        "padding only": [(5, 0)] * 4,
        "verify rows": [*((2, p) for p in range(20, 24)), (0, 7), *((1, p) for p in range(40, 43)), (3, 11), (3, 12)],
    }
    for name, pairs in steps.items():
        meta = _meta(pairs)
        q = torch.randn(1, len(pairs), kv * groups, dim).to(dtype).transpose(1, 2)  # [1, H, T, D], a view
        got = torch.ops.bucketserve.mixed_attention(q, k, v, meta, dim ** -0.5)
        want = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
        assert torch.equal(got, want) and got.stride() == want.stride() == q.stride(), name  # the fake's strides
    general: list[int] = []  # the C++ kernel's hand-overs to the Python one
    import models.mixed_attention as attention_module

    real_plan = attention_module.mixed_plan

    def watched(meta: bytes, spare: int, runs: int = 0) -> tuple[attention_module.Call, ...]:
        general.append(spare)
        return real_plan(meta, spare, runs)

    monkeypatch.setattr(attention_module, "mixed_plan", watched)
    meta = _meta(steps["rows then piece"])
    q = torch.randn(1, kv * groups, meta.shape[2], dim).to(dtype)
    torch.ops.bucketserve.mixed_attention(q, k, v, meta, dim ** -0.5)
    # switched off, or a build without a decode kernel for the dtype (bf16 on AVX2): the Python kernel does it all;
    # a build without the prompt kernel (AVX2 only) runs the piece through SDPA from C++ (the same bits, above)
    assert general == ([] if on and native.decode_kernel(dtype) else [slots])
    q48, k48, v48 = q[..., :48], k[..., :48].contiguous(), v[..., :48].contiguous()  # D % 32 != 0
    general.clear()
    got = torch.ops.bucketserve.mixed_attention(q48, k48, v48, meta, 48 ** -0.5)
    assert general == [slots] and torch.equal(got, _mixed_attention_cpu(q48, k48, v48, meta, 48 ** -0.5))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("on", [True, False])
def test_causal_attention_gives_the_python_kernels_bits(installed: None, dtype: torch.dtype, on: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's rows (views, as transformers passes them), and a head size the prompt kernel does not take (the
    Python kernel's SDPA): the same bits and strides as the Python kernel."""
    from models.attention import _causal_attention_cpu

    monkeypatch.setitem(native_library._switch, "on", on)
    torch.manual_seed(11)
    for b, n, dim in ((2, 24, 64), (1, 40, 32), (2, 17, 48)):
        q = torch.randn(b, n, 6, dim).to(dtype).transpose(1, 2)  # [b, H, n, D]
        k, v = (torch.randn(b, n, 2, dim).to(dtype).transpose(1, 2) for _ in range(2))
        got, ops = _profiled(lambda q=q, k=k, v=v, dim=dim: torch.ops.bucketserve.causal_attention(q, k, v, dim ** -0.5))
        want = _causal_attention_cpu(q, k, v, dim ** -0.5)
        assert torch.equal(got, want) and got.stride() == want.stride(), (b, n, dim)
        # else the Python kernel (SDPA), handed the whole call; the bf16 prompt kernel needs AVX512-BF16 in the build,
        # the fp32 one AVX-512 or AVX2 (piece_avx2.c)
        kernel = on and dim % 32 == 0 and native.has("piece_f32" if dtype == torch.float32 else "matmul")
        assert ("bucketserve::causal_attention_general" not in ops) == kernel, (b, n, dim)
