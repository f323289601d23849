"""float32 weights held exactly as 4-bit codes (models/exact4.py, models/csrc/exact4.c): a weight of Q4_1 form packs,
its codes rebuild every fp32 weight bit for bit, and the kernel's outputs are the fp32 tile copy's bits at every step
size; any other weight packs to None and keeps the fp32 tile copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import exact4, native_matmul
from models.prepack import _PACKED, prepack
from tests.support.q4 import q4_form

needs_kernel = pytest.mark.skipif(not exact4.available(), reason="needs the native kernels with AVX2 and FMA")


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return q4_form(torch.randn(n, k) * 0.1)


def rebuilt(codes: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The [N, K] fp32 weight the codes and pairs stand for, decoded by the layout exact4.c documents."""
    groups, k, _ = codes.shape
    low, high = (codes & 15).long(), (codes >> 4).long()  # [G, K, 16] each: columns i and 16 + i
    q = torch.cat((low, high), dim=2).double()  # [G, K, 32]
    d = pairs[:, :, 0].double().repeat_interleave(32, dim=1)  # [G, K, 32]
    m = pairs[:, :, 1].double().repeat_interleave(32, dim=1)
    return (q * d + m).float().transpose(1, 2).reshape(groups * 32, k)


@needs_kernel
def test_codes_rebuild_every_weight_bit_for_bit() -> None:
    w = weight(96, 160)
    packed = exact4.pack(w)
    assert packed is not None
    codes, pairs = packed
    assert codes.shape == (3, 160, 16) and pairs.shape == (3, 5, 2, 32)
    assert torch.equal(rebuilt(codes, pairs), w)


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 96), (192, 576), (32, 1536), (96, 160)])
def test_kernel_gives_the_fp32_tile_copys_bits(n: int, k: int) -> None:
    w = weight(n, k, seed=n + k)
    packed, tiles = exact4.pack(w), native_matmul.f32_tile_pack(w)
    assert packed is not None and tiles is not None
    codes, pairs = packed
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 64, 128):
        x = torch.randn(rows, k)
        got = native_matmul.packed_linear(x, (native_matmul.EXACT4_F32, codes.data_ptr(), pairs.data_ptr()), n)
        want = native_matmul.packed_linear(x, (native_matmul.TILED_F32, tiles.data_ptr(), 0), n)
        assert got is not None and want is not None
        assert torch.equal(got, want), rows
        torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_other_weights_do_not_pack() -> None:
    w = weight(64, 64)
    nudged = w.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one weight one ulp off its block's grid
    assert exact4.pack(nudged) is None
    assert exact4.pack(torch.randn(64, 64)) is None  # a weight of no 4-bit grid
    assert exact4.pack(weight(48, 64)) is None  # N not a multiple of 32
    assert exact4.pack(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert exact4.pack(w.to(torch.bfloat16)) is None


@needs_kernel
def test_prepack_reads_the_exact_copy_where_a_weight_has_one() -> None:
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(weight(64, 128, seed=3))
        model[1].weight.copy_(torch.randn(64, 64) * 0.1)  # not of that form: keeps the fp32 tile copy
    plain = [m.weight.detach().clone() for m in model]
    prepack(model)
    exact, other = (_PACKED[m.weight.data_ptr()] for m in model)
    assert exact.exact4 is not None and exact.tiles is None
    assert exact.one is not None and exact.one[0] == native_matmul.EXACT4_F32
    assert exact.few is not None and exact.few[0] == native_matmul.EXACT4_F32
    assert other.exact4 is None and other.tiles is not None
    tiles = native_matmul.f32_tile_pack(plain[0])
    assert tiles is not None
    for rows in (1, 5, 16):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            got = model[0](x)
        want = native_matmul.packed_linear(x, (native_matmul.TILED_F32, tiles.data_ptr(), 0), 64)
        assert want is not None and torch.equal(got, want)
