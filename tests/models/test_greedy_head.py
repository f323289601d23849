"""The float32 lm_head of greedy steps (models/greedy_head.py, models/csrc/greedy_head.c): with the switch on, each
row of a step of up to max_rows() (6) holds -inf but at its first maximum, whose index and value (bits) are the full
head's; with it off, or past max_rows() rows, the full logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from models import greedy_head, native_matmul
from models.prepack import _PACKED, prepack

needs_kernel = pytest.mark.skipif(not greedy_head.available(), reason="needs the native kernels with AVX2 and FMA")


class Head(nn.Module):
    """A model of one lm_head, as prepack finds it (get_output_embeddings, config.model_type)."""

    def __init__(self, weight: torch.Tensor, model_type: str = "llama", bias: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type)
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head


def packed_head(weight: torch.Tensor) -> nn.Module:
    model = Head(weight)
    prepack(model)
    entry = _PACKED[model.lm_head.weight.data_ptr()]
    assert entry.few is not None and entry.few[0] == native_matmul.GREEDY_HEAD_F32 and entry.screen is not None
    return model.lm_head


def maxima(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), greedy_head.maxima_only():
        out: torch.Tensor = head(x)
    return out


def full(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = head(x)
    return out


def assert_first_maxima(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each row of `got` is -inf but at `want`'s first maximum, which holds want's value there (the same bits)."""
    for g, w in zip(got, want):
        at = int(torch.argmax(w))
        assert int(torch.argmax(g)) == at
        assert g[at].item() == w[at].item()
        assert int((g > float("-inf")).sum()) == 1


@needs_kernel
def test_screen_copy_holds_the_weight_to_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 40) * 0.1
    screen = greedy_head.screen_pack(w)
    assert screen is not None and screen.numel() == 96 * 40 + 4 * 96 + 32
    q = screen[: 96 * 40].view(3, 40, 32).transpose(1, 2).reshape(96, 40).float()
    scale = screen[96 * 40 : 96 * 40 + 4 * 96].view(torch.float32)
    assert screen[-32:].view(torch.int64).tolist() == [w.data_ptr(), 0, 0, 0]  # the plain weight; no exact copy
    assert q.abs().max() <= 127
    assert torch.all((w - q * scale[:, None]).abs() <= scale[:, None] / 2 * (1 + 1e-5))
    assert greedy_head.screen_pack(torch.randn(40, 16)) is None  # N not a multiple of 32
    bad = w.clone()
    bad[3, 4] = float("inf")
    assert greedy_head.screen_pack(bad) is None


@needs_kernel
def test_the_screen_copy_packed_in_blocks_is_the_whole_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(7)
    w = torch.randn(160, 24)
    whole = greedy_head.screen_pack(w)
    monkeypatch.setattr(greedy_head, "_PACK_ROWS", 64)  # blocks of 64, 64 and 32 rows
    assert whole is not None and torch.equal(greedy_head.screen_pack(w), whole)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6])
def test_each_row_gets_the_full_heads_first_maximum(rows: int) -> None:
    assert rows <= greedy_head.max_rows()
    torch.manual_seed(rows)
    head = packed_head(torch.randn(2048, 96) * 0.05)
    x = torch.randn(rows, 96) * 2
    assert_first_maxima(maxima(head, x), full(head, x))


@needs_kernel
def test_past_max_rows_and_with_the_switch_off_the_full_logits() -> None:
    torch.manual_seed(1)
    w = torch.randn(1024, 64) * 0.05
    head = packed_head(w)
    x = torch.randn(greedy_head.max_rows() + 1, 64)
    tiles = native_matmul.f32_tile_pack(w)
    assert tiles is not None
    reference = native_matmul.tiled_matmul_f32(x, tiles)
    assert reference is not None
    assert torch.equal(full(head, x), reference)
    assert torch.equal(maxima(head, x), reference)  # one row past max_rows(): the full head
    assert torch.equal(full(head, x[:4]), reference[:4])


@needs_kernel
def test_a_near_tie_the_int8_estimate_orders_wrongly_is_settled_exactly() -> None:
    """Vocabulary rows 0 and 1 differ by less than the int8 copy resolves, so the estimate may rank them against
    their exact logits; row 1 is built (searched, deterministically) so that it does: only the bound's candidates,
    recomputed in fp32, find it."""
    k = 64
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(k, generator=gen) * 0.05
    x = (base * 20 + torch.randn(k, generator=gen) * 0.1).view(1, k)  # rows 0 and 1 lead by far
    for _ in range(2000):
        other = base + torch.randn(k, generator=gen) * 2e-4
        w = torch.cat([base[None], other[None], torch.randn(30, k, generator=gen) * 0.001])
        scale = w.abs().amax(dim=1) / 127
        estimate = (torch.round(w / scale[:, None]) * scale[:, None]) @ x[0]
        exact = w @ x[0]
        if exact[1] > exact[0] and estimate[0] > estimate[1]:
            break
    else:
        pytest.fail("no near tie found")
    head = packed_head(w)
    got, want = maxima(head, x), full(head, x)
    assert int(torch.argmax(want)) == 1
    assert_first_maxima(got, want)


@needs_kernel
def test_exact_ties_keep_the_first_index() -> None:
    torch.manual_seed(4)
    w = torch.randn(64, 32) * 0.05
    w[40] = w[7]  # the same logit at 7 and 40
    x = (w[7] * 10).view(1, 32)  # makes 7 (and 40) the maximum
    head = packed_head(w)
    got = maxima(head, x)
    assert int(torch.argmax(got)) == 7
    assert_first_maxima(got, full(head, x))


@needs_kernel
def test_zero_and_non_finite_rows() -> None:
    torch.manual_seed(5)
    head = packed_head(torch.randn(256, 32) * 0.05)
    x = torch.randn(3, 32)
    x[0] = 0.0  # a free slot: every logit +0, the first is the maximum
    x[2, 5] = float("inf")  # its bounds are not finite: the full head
    got, want = maxima(head, x), full(head, x)
    assert int(torch.argmax(got[0])) == 0 and got[0, 0].item() == 0.0
    assert_first_maxima(got[1:2], want[1:2])
    assert torch.equal(got[2].isnan(), want[2].isnan())
    assert torch.equal(got[2].nan_to_num(), want[2].nan_to_num())


@needs_kernel
@pytest.mark.parametrize(("model_type", "bias"), [("gemma2", False), ("granite", False), ("llama", True)])
def test_heads_whose_logits_change_after_them_are_not_screened(model_type: str, bias: bool) -> None:
    """A bias, soft-capping or scaling after the head can move the first maximum: those heads keep the full one."""
    model = Head(torch.randn(64, 32), model_type, bias)
    prepack(model)
    entry = _PACKED[model.lm_head.weight.data_ptr()]
    assert entry.screen is None and entry.few is not None and entry.few[0] == native_matmul.TILED_F32


@needs_kernel
def test_a_row_with_too_many_candidates_gets_the_full_logits() -> None:
    """Every vocabulary row the same: every logit ties, past the candidates worth recomputing one by one."""
    w = torch.randn(1, 48).expand(2048, 48).contiguous()
    head = packed_head(w)
    x = torch.randn(2, 48)
    got, want = maxima(head, x), full(head, x)
    assert torch.equal(got, want) and int(torch.argmax(got[0])) == 0


@needs_kernel
def test_two_threads_give_the_same_maxima() -> None:
    torch.manual_seed(6)
    head = packed_head(torch.randn(4096, 64) * 0.05)
    x = torch.randn(5, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = maxima(head, x)
        x[2] = torch.randn(64)  # a new row, and the others again: the per-thread lower bounds start afresh
        again = maxima(head, x)
    finally:
        torch.set_num_threads(before)
    want = full(head, x)
    assert_first_maxima(again, want)
    assert torch.equal(got[[0, 1, 3, 4]], again[[0, 1, 3, 4]])


def test_the_switch_is_off_outside_the_context() -> None:
    with greedy_head.maxima_only(False):
        pass
    if greedy_head.available():
        with greedy_head.maxima_only():
            assert greedy_head._switch().value == 1
        assert greedy_head._switch().value == 0
