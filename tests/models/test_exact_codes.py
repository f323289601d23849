"""float32 weights held exactly as small integer codes (models/exact_codes.py, models/csrc/exact_codes.c): a weight of
Q4_1 or Q8_0 form packs, its codes rebuild every fp32 weight bit for bit, and the kernels' outputs are the fp32 tile
copy's bits at every step size (the greedy head's full logits too); any other weight packs to None and keeps the fp32
tile copy."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from models import exact_codes, greedy_head, native_matmul
from models.prepack import _PACKED, prepack
from tests.support.exact_forms import q4_form, q8_form

needs_kernel = pytest.mark.skipif(not exact_codes.available(), reason="needs the native kernels with AVX2 and FMA")


def weight(n: int, k: int, seed: int = 0, form: Callable[[torch.Tensor], torch.Tensor] = q4_form) -> torch.Tensor:
    torch.manual_seed(seed)
    return form(torch.randn(n, k) * 0.1)


def rebuilt(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight the codes and pairs stand for, decoded by the layout exact_codes.c documents."""
    groups, k, _ = codes.shape
    low, high = (codes & 15).long(), (codes >> 4).long()  # [G, K, 16] each: columns i and 16 + i
    q = torch.cat((low, high), dim=2).double()  # [G, K, 32]
    d = pairs[:, :, 0].double().repeat_interleave(32, dim=1)  # [G, K, 32]
    m = pairs[:, :, 1].double().repeat_interleave(32, dim=1)
    return (q * d + m).float().transpose(1, 2).reshape(groups * 32, k)


@needs_kernel
def test_codes_rebuild_every_weight_bit_for_bit() -> None:
    w = weight(96, 160)
    packed = exact_codes.pack4(w)
    assert packed is not None
    codes, pairs = packed
    assert codes.shape == (3, 160, 16) and pairs.shape == (3, 5, 2, 32)
    assert torch.equal(rebuilt(codes, pairs), w)


@needs_kernel
def test_8_bit_codes_rebuild_every_weight_bit_for_bit() -> None:
    w = weight(64, 96, form=q8_form)
    assert exact_codes.pack4(w) is None  # more than 16 values a block
    packed = exact_codes.pack8(w)
    assert packed is not None
    codes, scales = packed
    assert codes.shape == (2, 96, 32) and scales.shape == (2, 3, 32)
    d = scales.repeat_interleave(32, dim=1)  # [G, K, 32]
    assert torch.equal((codes.float() * d).transpose(1, 2).reshape(64, 96), w)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(64, 96), (192, 576), (32, 1536), (96, 160)])
def test_kernel_gives_the_fp32_tile_copys_bits(n: int, k: int, bits: int) -> None:
    w = weight(n, k, seed=n + k, form=q4_form if bits == 4 else q8_form)
    packed = exact_codes.pack4(w) if bits == 4 else exact_codes.pack8(w)
    tiles = native_matmul.f32_tile_pack(w)
    assert packed is not None and tiles is not None
    codes, pairs = packed
    kind = native_matmul.EXACT4_F32 if bits == 4 else native_matmul.EXACT8_F32
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 64, 128):
        x = torch.randn(rows, k)
        got = native_matmul.packed_linear(x, (kind, codes.data_ptr(), pairs.data_ptr()), n)
        want = native_matmul.packed_linear(x, (native_matmul.TILED_F32, tiles.data_ptr(), 0), n)
        assert got is not None and want is not None
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_other_weights_do_not_pack() -> None:
    w = weight(64, 64)
    nudged = w.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one weight one ulp off its block's grid
    assert exact_codes.pack4(nudged) is None
    assert exact_codes.pack4(torch.randn(64, 64)) is None  # a weight of no 4-bit grid
    assert exact_codes.pack4(weight(48, 64)) is None  # N not a multiple of 32
    assert exact_codes.pack4(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert exact_codes.pack4(w.to(torch.bfloat16)) is None
    eight = weight(64, 64, form=q8_form)
    eight[3, 40] = torch.nextafter(eight[3, 40], torch.tensor(1.0))
    assert exact_codes.pack8(eight) is None
    assert exact_codes.pack8(torch.randn(64, 64)) is None


@needs_kernel
def test_prepack_reads_the_exact_copy_where_a_weight_has_one() -> None:
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight(64, 128, seed=3))
        model[1].weight.copy_(torch.randn(64, 64) * 0.1)  # not of that form: keeps the fp32 tile copy
    plain = [m.weight.detach().clone() for m in model]
    prepack(model)
    exact, other = (_PACKED[m.weight.data_ptr()] for m in model)
    assert exact.exact is not None and exact.tiles is None
    assert exact.one is not None and exact.one[0] == native_matmul.EXACT4_F32
    assert exact.few is not None and exact.few[0] == native_matmul.EXACT4_F32
    assert other.exact is None and other.tiles is not None
    tiles = native_matmul.f32_tile_pack(plain[0])
    assert tiles is not None
    for rows in (1, 5, 16):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            got = model[0](x)
        want = native_matmul.packed_linear(x, (native_matmul.TILED_F32, tiles.data_ptr(), 0), 64)
        assert want is not None and torch.equal(got, want)


@needs_kernel
def test_a_head_of_8_bit_codes_gives_its_full_logits_from_them() -> None:
    """A fp32 lm_head of Q8_0 form (the default model's): its full logits (past the screen's rows, or with the switch
    off) from the 8-bit copy up to 16 rows and from the fp32 tiles past them, the same bits; the screen's maxima as
    before."""
    from tests.models.test_greedy_head import Head, assert_first_maxima

    w = weight(416, 64, seed=7, form=q8_form)
    model = Head(w)
    prepack(model)
    entry = _PACKED[model.lm_head.weight.data_ptr()]
    assert entry.tiles is not None and entry.exact is not None and entry.screen is not None
    assert entry.few is not None and entry.few[0] == native_matmul.GREEDY_HEAD_F32
    tiles = native_matmul.f32_tile_pack(w)
    assert tiles is not None
    for rows in (1, 3, 6, 7, 16, 17, 40):
        x = torch.randn(rows, 64)
        want = native_matmul.packed_linear(x, (native_matmul.TILED_F32, tiles.data_ptr(), 0), 416)
        assert want is not None
        with torch.no_grad():
            assert torch.equal(model.lm_head(x), want)
            with greedy_head.maxima_only():
                got = model.lm_head(x)
        if rows <= greedy_head.max_rows():
            assert_first_maxima(got, want)
        else:
            assert torch.equal(got, want)
    # which copy each size read: with the tile copy zeroed, up to 16 rows still give the logits, more give zeros
    assert entry.tiles is not None
    entry.tiles.zero_()
    for rows, read_exact in ((7, True), (16, True), (17, False)):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            got = model.lm_head(x)
        assert bool(got.abs().sum() > 0) == read_exact, rows
        if read_exact:
            torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)
