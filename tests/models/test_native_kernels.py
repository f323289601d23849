"""bucketserve's own kernels (models/native.py, models/native_matmul.py): they build here; decode attention equals
attention in float32 to bf16 rounding over each row's own slot and extent and never reads past an extent; the small
matmul, the AMX matmul and the vector matmuls on the tile copies equal a float32 matmul to bf16 (fp32) rounding; the
attention ops and the prepacked linear use them for bf16 and fp32 decoding rows, and steps of 1-128 rows (falling
back to SDPA and oneDNN where they do not apply or are switched off)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import models.attention as attention_module
from models import native, native_library, native_matmul
from models.attention import packed_sdpa
from models.hardware import cpu_flags
from models.mixed_attention import _mixed_attention_cpu, mixed_plan
from models.prepack import linear_cpu, prepack
from tests.models.test_attention import FakeAttention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[int], extents: list[int],
               scale: float) -> torch.Tensor:
    """float32 attention of row r (q [R, H_kv, G, D]) over positions [0, extents[r]) of slot slots[r]."""
    rows = [F.scaled_dot_product_attention(q[r : r + 1].float(), k[s : s + 1, :, :e].float(),
                                           v[s : s + 1, :, :e].float(), scale=scale)
            for r, (s, e) in enumerate(zip(slots, extents, strict=True))]
    return torch.cat(rows)


def _poisoned_cache(slots: int, heads: int, context: int, dim: int, extents: dict[int, int],
                    dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [slots, heads, context, dim], NaN past each listed slot's extent: reading there shows."""
    k = torch.randn(slots, heads, context, dim).to(dtype)
    v = torch.randn(slots, heads, context, dim).to(dtype)
    for slot, extent in extents.items():
        k[slot, :, extent:] = float("nan")
        v[slot, :, extent:] = float("nan")
    return k, v


def _needs_decode_kernel(dtype: torch.dtype) -> None:
    """Skip where this build has no decode kernel for `dtype` that beats SDPA (bf16 on an AVX2-only CPU)."""
    if not native.decode_kernel(dtype):
        pytest.skip(f"no {dtype} decode kernel on this CPU (SDPA runs)")


# the dtype of the tests that watch the kernel run: bf16 where it has a kernel, else fp32 (an AVX2-only CPU)
KERNEL_DTYPE = torch.bfloat16 if native.decode_kernel(torch.bfloat16) else torch.float32


def test_the_kernels_build_and_load_here() -> None:
    """CI machines have the C compiler inductor needs; a silent fallback would only show as a slow bench. A CPU
    with AVX2 and FMA has an fp32 decode kernel (decode_attention.c's, or decode_avx2.c's without AVX-512) and the
    fp32 vector matmul: for steps of up to 32 rows in its AVX-512 form, up to 128 in its AVX2 one."""
    assert native.available()
    flags = cpu_flags()
    if {"avx2", "fma"} <= flags:
        assert native.decode_kernel(torch.float32)
        assert native.decode_kernel(torch.bfloat16) == ("avx512f" in flags)
        assert native_matmul.tiled_f32_rows() == (32 if "avx512_bf16" in flags else 128)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The kernels split their work over torch's thread count (OpenMP): both ways give the same result."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# bf16 rounds the result; fp32 differs from SDPA only by the order of its sums and the exp approximation (~1e-7)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 2e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("groups", "dim"), [(3, 64), (4, 64), (4, 128), (2, 16), (5, 32), (1, 64)])
def test_kernel_equals_float32_attention_over_each_rows_slot(groups: int, dim: int, dtype: torch.dtype,
                                                             threads: int) -> None:
    _needs_decode_kernel(dtype)
    torch.manual_seed(groups * 1000 + dim)
    heads, context = 2, 200
    # Rows read slots out of order; extents cover 1, either side of a block of 16 and of a chunk of 64 (the
    # kernel's softmax runs a chunk at a time), several chunks, and the whole slot.
    slots, extents = [4, 0, 2, 5, 1, 3, 7, 6], [1, 15, 17, 47, 63, 64, 65, 200]
    k, v = _poisoned_cache(8, heads, context, dim, dict(zip(slots, extents, strict=True)), dtype)
    q = torch.randn(len(slots), heads, groups, dim).to(dtype)
    scale = dim ** -0.5
    got = native.decode_attention(q, k, v, np.array(slots), np.array(extents), scale)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    assert torch.isfinite(got).all()  # nothing past an extent was read
    want = _reference(q, torch.nan_to_num(k), torch.nan_to_num(v), slots, extents, scale)
    torch.testing.assert_close(got.float(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_kernel_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k = torch.randn(2, 2, 3, 64), torch.randn(2, 2, 32, 64)
    ext, slots = np.array([5, 9]), np.arange(2)
    assert native.decode_attention(q.half(), k.half(), k.half(), slots, ext, 0.125) is None  # float16: SDPA
    assert native.decode_attention(q, k.bfloat16(), k.bfloat16(), slots, ext, 0.125) is None  # mixed dtypes
    odd_q, odd_k = torch.randn(2, 2, 3, 24).bfloat16(), torch.randn(2, 2, 32, 24).bfloat16()
    assert native.decode_attention(odd_q, odd_k, odd_k, slots, ext, 0.2) is None  # head dim not a multiple of 16
    q16, k16 = q.bfloat16(), k.bfloat16()
    with pytest.raises(ValueError, match="out of range"):
        native.decode_attention(q16, k16, k16, slots, np.array([5, 33]), 0.125)
    monkeypatch.setitem(native_library._switch, "on", False)
    assert native.decode_attention(q16, k16, k16, slots, ext, 0.125) is None


def _decode_mask(extents: list[int], context: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    seen = torch.arange(context)[None] < torch.tensor(extents)[:, None]
    return torch.where(seen, 0.0, float("-inf")).to(dtype).view(len(extents), 1, 1, context)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each call the attention ops make to the decode kernel (either entry): whether it ran (True) or declined
    (False)."""
    calls: list[bool] = []

    def counting(name: str) -> Callable[..., torch.Tensor | None]:
        real = getattr(native, name)

        def counted(*args: object) -> torch.Tensor | None:
            out: torch.Tensor | None = real(*args)
            calls.append(out is not None)
            return out
        return counted

    for name in ("decode_attention", "decode_attention_masked"):
        monkeypatch.setattr(f"models.attention.{name}", counting(name))
    monkeypatch.setattr("models.mixed_attention.decode_attention", counting("decode_attention"))
    # the op's Python kernel, which these tests watch (its C++ one chooses alike: tests/models/test_native_dispatch.py)
    monkeypatch.setattr(torch.ops.bucketserve, "attention", attention_module._attention_cpu)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_step_attention_uses_the_kernel_and_matches_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                                 kernel_calls: list[bool], dtype: torch.dtype) -> None:
    _needs_decode_kernel(dtype)
    torch.manual_seed(1)
    kv, groups, dim, context = 2, 3, 64, 64
    extents = [3, 40, 17, 64]
    q = torch.randn(4, kv * groups, 1, dim).to(dtype)
    k, v = _poisoned_cache(4, kv, context, dim, dict(enumerate(extents)), dtype)
    mask = _decode_mask(extents, context, dtype)
    ours, _ = packed_sdpa(FakeAttention(), q, k, v, mask, scaling=dim ** -0.5)
    assert kernel_calls == [True] and torch.isfinite(ours).all()  # one call: the entry that reads the mask
    monkeypatch.setitem(native_library._switch, "on", False)
    clean_k, clean_v = torch.nan_to_num(k), torch.nan_to_num(v)
    sdpa, _ = packed_sdpa(FakeAttention(), q, clean_k, clean_v, mask, scaling=dim ** -0.5)
    assert kernel_calls == [True, False, False]  # both entries declined: SDPA
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_kernel_stays_off_where_it_loses_to_sdpa(monkeypatch: pytest.MonkeyPatch, kernel_calls: list[bool],
                                                         dtype: torch.dtype) -> None:
    """A build with no decode kernel for the dtype that beats SDPA (bf16 on an AVX2-only CPU, where the 16-lane one
    is 3-4x slower): both entries decline, and a decode step's attention is SDPA's, bit for bit."""
    if not native.available():
        pytest.skip("native kernels unavailable")
    torch.manual_seed(4)
    kv, groups, dim, context = 2, 3, 64, 64
    extents = [3, 40, 17, 64]
    q = torch.randn(4, kv * groups, 1, dim).to(dtype)
    k, v = (torch.randn(4, kv, context, dim).to(dtype) for _ in range(2))
    mask = _decode_mask(extents, context, dtype)
    monkeypatch.setitem(native_library._state, "decode_f32" if dtype == torch.float32 else "decode_bf16", False)
    assert not native.decode_kernel(dtype)
    slower, _ = packed_sdpa(FakeAttention(), q, k, v, mask, scaling=dim ** -0.5)
    assert kernel_calls == [False, False]  # both entries declined
    monkeypatch.setitem(native_library._switch, "on", False)
    sdpa, _ = packed_sdpa(FakeAttention(), q, k, v, mask, scaling=dim ** -0.5)
    assert torch.equal(slower, sdpa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [torch.bfloat16, torch.float32])
def test_masked_entry_reads_extents_from_the_mask(width: torch.dtype, dtype: torch.dtype, threads: int) -> None:
    """decode_attention_masked == decode_attention with row r on slot r and the mask's extents; it declines
    (None) where a row's visible positions are not a non-empty prefix, which the general path then handles."""
    _needs_decode_kernel(dtype)
    torch.manual_seed(3)
    kv, groups, dim, context = 3, 3, 64, 96
    extents = [1, 16, 17, 95, 40]
    q = torch.randn(len(extents), kv, groups, dim).to(dtype)
    k, v = _poisoned_cache(len(extents) + 1, kv, context, dim, dict(enumerate(extents)), dtype)
    mask = _decode_mask(extents, 80 if max(extents) <= 80 else context).to(width)
    got = native.decode_attention_masked(q, k, v, mask, dim ** -0.5)
    want = native.decode_attention(q, k, v, np.arange(len(extents)), np.array(extents), dim ** -0.5)
    assert got is not None and want is not None and torch.isfinite(got).all()
    assert torch.equal(got, want)
    window = mask.clone()
    window[3, ..., :10] = float("-inf")  # row 3 sees [10, 95): not a prefix
    assert native.decode_attention_masked(q, k, v, window, dim ** -0.5) is None
    empty = mask.clone()
    empty[0] = float("-inf")  # row 0 sees nothing
    assert native.decode_attention_masked(q, k, v, empty, dim ** -0.5) is None
    assert native.decode_attention_masked(q.half(), k.half(), v.half(), mask, dim ** -0.5) is None


def test_mixed_step_decoding_rows_use_the_kernel(monkeypatch: pytest.MonkeyPatch, kernel_calls: list[bool]) -> None:
    """A mixed step of two decoding rows (slots 1, 2) and a prompt piece (slot 0): the same output with the
    kernel and with SDPA (the op's Python kernel; its C++ one gives the same bits: test_native_dispatch.py)."""
    torch.manual_seed(2)
    kv, groups, dim, context = 2, 3, 64, 48
    heads = kv * groups
    pairs = [(1, 20), (2, 33), *((0, p) for p in range(10)), (3, 0)]  # slot 3: the spare slot (padding)
    meta = torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)
    assert [c.decoding for c in mixed_plan(meta.numpy().tobytes(), 3)] == [True, False]
    q = torch.randn(1, heads, len(pairs), dim).to(KERNEL_DTYPE)
    k, v = torch.randn(4, kv, context, dim).to(KERNEL_DTYPE), torch.randn(4, kv, context, dim).to(KERNEL_DTYPE)
    ours = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    assert kernel_calls == [True]
    monkeypatch.setitem(native_library._switch, "on", False)
    sdpa = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=1e-2, atol=1e-2)
    assert not ours[:, :, 12:].any()  # padding (the prompt piece has a kernel of its own: test_piece_attention.py)


def test_verify_runs_go_to_sdpa_as_pieces_where_the_decode_kernel_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the decode kernel (it loses to SDPA on AVX2) a verify step's row and its drafts (one slot, consecutive
    positions) attend in one SDPA call under a causal mask, not one call a token: the same result as a call a token
    to fp32 rounding, and a lone decoding row stays a decoding row."""
    import models.mixed_attention as mixed

    if not native.available():
        pytest.skip("native kernels unavailable")
    monkeypatch.setitem(native_library._state, "decode_f32", False)
    torch.manual_seed(5)
    kv, groups, dim, context = 3, 3, 64, 64
    pairs = [*((1, p) for p in range(30, 34)), (2, 40), *((0, p) for p in range(20, 23))]
    meta = torch.tensor(pairs, dtype=torch.long).view(1, 1, len(pairs), 2)
    q = torch.randn(1, kv * groups, len(pairs), dim)
    k, v = torch.randn(4, kv, context, dim), torch.randn(4, kv, context, dim)
    plans: list[int] = []
    real_plan = mixed.mixed_plan

    def watched(data: bytes, spare: int, runs: int = 0) -> tuple[mixed.Call, ...]:
        plans.append(runs)
        return real_plan(data, spare, runs)

    monkeypatch.setattr(mixed, "mixed_plan", watched)
    pieces = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    assert plans == [mixed.SDPA_RUN]
    assert [(c.first, c.last, c.decoding) for c in real_plan(meta.numpy().tobytes(), 3, plans[0])] == [
        (0, 4, False), (4, 5, True), (5, 8, False)]
    monkeypatch.setattr(mixed, "SDPA_RUN", 0)
    per_token = _mixed_attention_cpu(q, k, v, meta, dim ** -0.5)
    assert plans[1:] == [0]
    torch.testing.assert_close(pieces, per_token, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_small_matmul_equals_a_float32_matmul(rows: int, out_features: int, in_features: int, threads: int) -> None:
    torch.manual_seed(rows * out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * in_features ** -0.5).bfloat16()
    got = native_matmul.small_matmul(x, w)
    if got is None:  # a CPU without AVX512-BF16: the kernel declines, oneDNN runs
        pytest.skip("no AVX512-BF16 on this CPU")
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)
    bias = torch.randn(out_features).bfloat16()
    with_bias = native_matmul.small_matmul(x, w, bias)
    assert with_bias is not None
    torch.testing.assert_close(with_bias.float(), x.float() @ w.float().T + bias.float(), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 16), (48, 64), (960, 576), (576, 1536)])
def test_float32_one_row_matmul_equals_mkl(out_features: int, in_features: int, threads: int) -> None:
    """The fp32 one-row matmul (small_matmul.c, 16 weight rows at a time) equals MKL's to fp32 rounding, and
    declines more rows and weights whose sizes are not multiples of 16."""
    torch.manual_seed(out_features + in_features)
    w = torch.randn(out_features, in_features) * in_features ** -0.5
    x = torch.randn(1, in_features)
    if not native_matmul.one_row_f32_takes(w):
        pytest.skip("no AVX-512 kernels on this CPU")
    kernel = (native_matmul.ONE_ROW_F32, w.data_ptr(), 0)
    got = native_matmul.packed_linear(x, kernel, out_features)
    assert got is not None and got.dtype == torch.float32 and got.shape == (1, out_features)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
    assert native_matmul.packed_linear(torch.randn(2, in_features), kernel, out_features) is None  # one row only
    assert not native_matmul.one_row_f32_takes(torch.randn(out_features + 8, in_features))
    assert not native_matmul.one_row_f32_takes(w.bfloat16())


def test_small_matmul_declines_what_it_does_not_take() -> None:
    w = torch.randn(48, 64).bfloat16()
    assert native_matmul.small_matmul(torch.randn(5, 64).bfloat16(), w) is None  # 5 rows: oneDNN's
    assert native_matmul.small_matmul(torch.randn(1, 64), w.float()) is None  # float32: the reference path
    assert native_matmul.small_matmul(torch.randn(1, 40).bfloat16(), torch.randn(48, 40).bfloat16()) is None  # K % 32
    assert native_matmul.small_matmul(torch.randn(1, 64).bfloat16(), torch.randn(40, 64).bfloat16()) is None  # N % 16


def test_prepacked_linears_route_by_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, one row: the small matmul, 2-128 rows: the AMX matmul, more rows (prompts): oneDNN; without, every
    step size the vector matmul on the tile copy. Each gives the plain linear's result to bf16 rounding. (The op's
    Python kernel; its C++ one makes the same choices: tests/models/test_native_dispatch.py.)"""
    torch.manual_seed(3)
    layer = torch.nn.Linear(64, 96, bias=False).bfloat16().requires_grad_(False)
    inputs = {rows: torch.randn(rows, 1, 64).bfloat16() for rows in (1, 2, 4, 5, 128, 129)}
    plain = {rows: torch.nn.functional.linear(x, layer.weight) for rows, x in inputs.items()}
    prepack(layer)
    taken: list[tuple[str, int]] = []
    monkeypatch.setattr("models.prepack.packed_linear", _counting(taken))
    for rows, x in inputs.items():
        torch.testing.assert_close(linear_cpu(x, layer.weight, None), plain[rows], rtol=1e-2, atol=1e-2)
    if native_matmul.small_matmul(inputs[1][0], layer.weight) is None:
        pytest.skip("no AVX512-BF16 on this CPU")
    if native_matmul.amx_available():
        assert taken == [("tiled", 1), ("amx", 2), ("amx", 4), ("amx", 5), ("amx", 128)]  # 129 rows: oneDNN
    else:
        assert taken == [("tiled", 1), ("tiled", 2), ("tiled", 4), ("tiled", 5), ("tiled", 128), ("tiled", 129)]


def _counting(taken: list[tuple[str, int]]) -> Callable[[torch.Tensor, native_matmul.Kernel, int], torch.Tensor | None]:
    """packed_linear, recording (kernel name, rows) of each call a kernel of ours took."""
    names = {native_matmul.SMALL: "small", native_matmul.AMX: "amx", native_matmul.AMX_INT8: "int8",
             native_matmul.TILED: "tiled", native_matmul.TILED_INT8: "int8"}
    real = native_matmul.packed_linear

    def counted(x: torch.Tensor, kernel: native_matmul.Kernel, n: int) -> torch.Tensor | None:
        out = real(x, kernel, n)
        if out is not None:
            taken.append((names[kernel[0]], x.numel() // x.shape[-1]))
        return out

    return counted


def test_a_weight_without_a_tile_copy_takes_the_small_matmul_for_one_and_two_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AMX, a weight the tiles cannot hold (N = 48: not a multiple of 32) still takes the small matmul for
    1-2 rows and oneDNN from 3 rows on."""
    if native_matmul.amx_available() or not native_matmul.tiled_available():
        pytest.skip("needs AVX512-BF16 without AMX")
    torch.manual_seed(4)
    layer = torch.nn.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    inputs = {rows: torch.randn(rows, 64).bfloat16() for rows in (1, 2, 3)}
    plain = {rows: torch.nn.functional.linear(x, layer.weight) for rows, x in inputs.items()}
    prepack(layer)
    taken: list[tuple[str, int]] = []
    monkeypatch.setattr("models.prepack.packed_linear", _counting(taken))
    for rows, x in inputs.items():
        torch.testing.assert_close(linear_cpu(x, layer.weight, None), plain[rows], rtol=1e-2, atol=1e-2)
    assert taken == [("small", 1), ("small", 2)]


def _amx_or_skip() -> None:
    if not native_matmul.amx_available():
        pytest.skip("no AMX on this CPU (or Linux does not grant the tile state)")


def _tiles_or_skip() -> None:
    if not (native_matmul.amx_available() or native_matmul.tiled_available()):
        pytest.skip("no AMX and no AVX512-BF16 on this CPU: no kernel reads a tile copy")


def test_tile_pack_puts_each_weight_pair_where_the_tiles_read_it() -> None:
    _tiles_or_skip()
    w = torch.randn(64, 96).bfloat16()
    packed = native_matmul.tile_pack(w)
    assert packed is not None and packed.shape == (2, 3, 2, 16, 16, 2)
    for g, b, j, r, n, i in [(0, 0, 0, 0, 0, 0), (1, 2, 1, 15, 15, 1), (0, 1, 1, 3, 7, 0), (1, 0, 0, 9, 2, 1)]:
        assert packed[g, b, j, r, n, i] == w[32 * g + 16 * j + n, 32 * b + 2 * r + i]


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 16, 17, 25, 33, 128])
@pytest.mark.parametrize("kernel", ["amx", "tiled"])
def test_tile_matmuls_equal_a_float32_matmul(kernel: str, rows: int, out_features: int, in_features: int,
                                             threads: int) -> None:
    """The AMX matmul (2-128 rows) and the vector matmul on the same tile copy (1-128; CPUs without AMX, and on AMX
    CPUs too when called): every row count in their blocks (the vector one's passes of up to 12 rows, the first a
    full one: 13 = 12 + 1, 16 = 12 + 4, 25 = 12 + 6 + 7), each thread's share of the column groups."""
    if kernel == "amx":
        _amx_or_skip()
        if rows < native_matmul.AMX_MIN_ROWS:
            pytest.skip("one row is the vector matmul's")
    elif not (native.available() and native.has("matmul")):
        pytest.skip("no AVX512-BF16 on this CPU")
    matmul = native_matmul.amx_matmul if kernel == "amx" else native_matmul.tiled_matmul
    torch.manual_seed(rows * out_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = (torch.randn(out_features, in_features) * in_features ** -0.5).bfloat16()
    packed = native_matmul._tiled(w)
    got = matmul(x, packed)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=1e-2, atol=1e-2)
    bias = torch.randn(out_features).bfloat16()
    with_bias = matmul(x, packed, bias)
    assert with_bias is not None
    torch.testing.assert_close(with_bias.float(), x.float() @ w.float().T + bias.float(), rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 40), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 12, 13, 14, 20, 25, 32, 77, 128])
def test_tiled_matmul_f32_equals_a_float32_matmul(rows: int, out_features: int, in_features: int,
                                                  threads: int) -> None:
    """The fp32 vector matmul on the fp32 tile copy (AVX-512, or AVX2: 1-2 rows over whole column groups, more in
    passes of up to 6 rows over half groups, each prefetching a slice of the next group: equal passes (9 = 4 + 5,
    25 = 5 x 5), or 6-row passes and a last 1-2 rows over whole groups (7 = 6 + 1, 8 = 6 + 2, 13 = 6 + 6 + 1, 14,
    20)): within fp32 rounding of PyTorch's (another order of sums), and each row's bits whatever pass it ran in
    (its first and last rows alone). Up to tiled_f32_rows() rows (32 with AVX-512, 128 with AVX2); one more is
    oneDNN's."""
    if not (native.available() and native.has("f32")):
        pytest.skip("no AVX-512 or AVX2 kernels on this CPU")
    if rows > native_matmul.tiled_f32_rows():
        pytest.skip("past the rows this build's kernel takes")
    torch.manual_seed(rows * out_features + 2)
    x = torch.randn(rows, in_features)
    w = torch.randn(out_features, in_features) * in_features ** -0.5
    packed = native_matmul.f32_tile_pack(w)
    assert packed is not None and packed.shape == (out_features // 32, in_features, 32)
    assert packed[1, 3, 5] == w[37, 3]
    got = native_matmul.tiled_matmul_f32(x, packed)
    assert got is not None and got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
    alone = native_matmul.tiled_matmul_f32(x[rows - 1:], packed)  # each sum in k order: a row's bits in any call
    assert alone is not None and torch.equal(alone, got[rows - 1:])
    first = native_matmul.tiled_matmul_f32(x[:1], packed)
    assert first is not None and torch.equal(first, got[:1])
    over = torch.randn(native_matmul.tiled_f32_rows() + 1, in_features)
    assert native_matmul.tiled_matmul_f32(over, packed) is None  # oneDNN's
    assert native_matmul.f32_tile_pack(torch.randn(48, in_features)) is None  # N % 32
    assert native_matmul.f32_tile_pack(w.bfloat16()) is None


def test_tiled_matmul_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    if not (native.available() and native.has("matmul")):
        pytest.skip("no AVX512-BF16 on this CPU")
    packed = native_matmul._tiled(torch.randn(96, 64).bfloat16())
    assert native_matmul.tiled_matmul(torch.randn(0, 64).bfloat16(), packed) is None  # no rows
    assert native_matmul.tiled_matmul(torch.randn(4, 64), packed) is None  # float32: the reference path
    assert native_matmul.tiled_matmul(torch.randn(4, 32).bfloat16(), packed) is None  # K does not match
    monkeypatch.setitem(native_library._switch, "on", False)
    assert native_matmul.tiled_matmul(torch.randn(4, 64).bfloat16(), packed) is None  # --no-native-kernels


def test_the_tiled_matmul_gives_a_row_the_same_bits_in_a_prompt_sized_call() -> None:
    """Without AMX the vector matmul serves every step size (prompts too): a row's output is the same bits whether
    it is one of 3 rows or of 300 (each sum runs in k order, whatever the other rows)."""
    if not (native.available() and native.has("matmul")):
        pytest.skip("no AVX512-BF16 on this CPU")
    torch.manual_seed(5)
    packed = native_matmul._tiled(torch.randn(96, 64).bfloat16())
    x = torch.randn(300, 64).bfloat16()
    whole = native_matmul.tiled_matmul(x, packed)
    few = native_matmul.tiled_matmul(x[137:140], packed)
    assert whole is not None and few is not None
    assert torch.equal(whole[137:140], few)


def test_amx_matmul_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    _amx_or_skip()
    w = torch.randn(96, 64).bfloat16()
    packed = native_matmul.tile_pack(w)
    assert packed is not None
    assert native_matmul.amx_matmul(torch.randn(1, 64).bfloat16(), packed) is None  # one row: the small matmul's
    assert native_matmul.amx_matmul(torch.randn(129, 64).bfloat16(), packed) is None  # a prompt: oneDNN's
    assert native_matmul.amx_matmul(torch.randn(4, 64), packed) is None  # float32: the reference path
    assert native_matmul.amx_matmul(torch.randn(4, 32).bfloat16(), packed) is None  # K does not match
    assert native_matmul.tile_pack(torch.randn(48, 64).bfloat16()) is None  # N % 32
    assert native_matmul.tile_pack(torch.randn(96, 40).bfloat16()) is None  # K % 32
    assert native_matmul.tile_pack(w.float()) is None
    monkeypatch.setitem(native_library._switch, "on", False)
    assert native_matmul.amx_matmul(torch.randn(4, 64).bfloat16(), packed) is None  # --no-native-kernels


def test_decode_reads_a_kv_bucket_of_the_slot_buffers(kernel_calls: list[bool]) -> None:
    """A decode step of KV bucket 32 over slot buffers of 64 positions: the kernel gets the bucket's view
    (same strides as the buffers, fewer positions) and must walk the buffers' real strides."""
    torch.manual_seed(4)
    kv, groups, dim, context, bucket = 2, 3, 64, 64, 32
    extents = [5, 32, 17]
    q = torch.randn(3, kv * groups, 1, dim).to(KERNEL_DTYPE)
    k, v = _poisoned_cache(3, kv, context, dim, dict(enumerate(extents)), KERNEL_DTYPE)
    ours, _ = packed_sdpa(FakeAttention(), q, k, v, _decode_mask(extents, bucket, KERNEL_DTYPE), scaling=dim ** -0.5)
    assert kernel_calls == [True]
    packed = q.reshape(3, kv, groups, dim)
    want = _reference(packed, torch.nan_to_num(k), torch.nan_to_num(v), [0, 1, 2], extents, dim ** -0.5)
    torch.testing.assert_close(ours.float(), want.reshape(3, 1, kv * groups, dim), rtol=1e-2, atol=1e-2)


def test_sliding_window_rows_keep_sdpa(kernel_calls: list[bool]) -> None:
    """A row whose window cuts its start (positions [ext - w, ext)) is not a prefix: the kernel (which reads
    from position 0) must not run; SDPA applies the mask."""
    torch.manual_seed(5)
    kv, groups, dim, context, window = 2, 3, 64, 48, 8
    extents = [30, 6]
    q = torch.randn(2, kv * groups, 1, dim).to(torch.bfloat16)
    k = torch.randn(2, kv, context, dim).to(torch.bfloat16)
    v = torch.randn(2, kv, context, dim).to(torch.bfloat16)
    pos = torch.arange(context)[None]
    ext = torch.tensor(extents)[:, None]
    seen = (pos < ext) & (pos >= ext - window)
    mask = torch.where(seen, 0.0, float("-inf")).to(torch.bfloat16).view(2, 1, 1, context)
    ours, _ = packed_sdpa(FakeAttention(), q, k, v, mask, scaling=dim ** -0.5)
    assert kernel_calls == [False]  # the mask-reading entry declines; the general one is not asked
    packed = q.reshape(2, kv, groups, dim).float()
    want = torch.cat([F.scaled_dot_product_attention(packed[r : r + 1], k[r : r + 1, :, e - min(e, window) : e].float(),
                                                     v[r : r + 1, :, e - min(e, window) : e].float(), scale=dim ** -0.5)
                      for r, e in enumerate(extents)])
    torch.testing.assert_close(ours.float(), want.reshape(2, 1, kv * groups, dim), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mask_extents_scan_equals_the_numpy_scan(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C scan of a mask's rows gives what the numpy scan gives: prefixes, a sliding window, a hole, a row that
    attends nothing, a row that attends everything."""
    from models.attention import _extents

    width = 64
    attend = [range(0, 5), range(0, 1), range(10, 20), [*range(0, 3), 7], [], range(0, width)]
    mask = torch.full((len(attend), 1, 1, width), float("-inf"), dtype=dtype)
    for r, seen in enumerate(attend):
        mask[r, 0, 0, list(seen)] = 0.0
    got = _extents(mask)
    assert native.mask_extents(mask[:, 0, -1]) is not None  # the C scan ran
    monkeypatch.setitem(native_library._switch, "on", False)
    assert got == _extents(mask) == ((5, 1, 20, 8, width, width), False)
    monkeypatch.setitem(native_library._switch, "on", True)
    prefixes = mask[[0, 1, 5]]
    assert _extents(prefixes) == ((5, 1, width), True)


@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [2, 9, 16])
def test_amx_matmul_gives_a_row_the_same_bits_whatever_rows_share_the_call(rows: int, out_features: int,
                                                                          in_features: int, threads: int) -> None:
    """Up to 16 rows take column groups in pairs (two streams from memory); a row's sums run in the same order as in
    a call of more rows, so its output is the same bits: a greedy row's tokens do not depend on the step's size."""
    _amx_or_skip()
    torch.manual_seed(rows + out_features)
    x = torch.randn(40, in_features).bfloat16()
    packed = native_matmul._tiled((torch.randn(out_features, in_features) * in_features ** -0.5).bfloat16())
    few, many = native_matmul.amx_matmul(x[:rows], packed), native_matmul.amx_matmul(x, packed)
    assert few is not None and many is not None
    assert torch.equal(few, many[:rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [5, 16, 49152, 49157])
def test_argmax_equals_torch_max_indices(dtype: torch.dtype, vocab: int, threads: int) -> None:
    """The greedy kernel against torch.max's indices: ties (the first), a NaN anywhere (the first NaN: at 0, in the
    vector part, in the tail past the last 16), -inf rows, -0.0 beside +0.0, rows strided inside a wider tensor."""
    if not native.available():
        pytest.skip("no native kernels here")
    torch.manual_seed(vocab)
    wide = torch.randn(10, vocab + 3).to(dtype)
    logits = wide[:, :vocab]  # row stride vocab + 3
    last = vocab - 1
    logits[1, [0, last]] = 50.0
    logits[2, :] = 0.0
    logits[2, 0] = -0.0
    logits[3, [min(3, last), last]] = float("nan")
    logits[4, 0] = float("nan")
    logits[5, last] = float("nan")
    logits[6, :] = float("-inf")
    logits[7, last] = 99.0
    logits[8, [1 % vocab, last]] = float("inf")
    got = native.argmax(logits)
    assert got == logits.max(dim=-1).indices.tolist()
    assert got[1] == 0 and got[2] == 0 and got[4] == 0 and got[5] == last and got[6] == 0 and got[7] == last
    assert native.argmax(logits[:1]) == got[:1]
    assert native.argmax(logits.half()) is None  # not a dtype it takes: the caller's torch.max
