from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from models.attention import packed_sdpa
from models.row_segments import segments


class FakeAttention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def test_packed_gqa_decode_equals_stock_sdpa() -> None:
    torch.manual_seed(0)
    b, kv, groups, context, dim = 4, 2, 3, 32, 16
    q = torch.randn(b, kv * groups, 1, dim)
    k, v = torch.randn(b, kv, context, dim), torch.randn(b, kv, context, dim)
    pos = torch.tensor([0, 5, 17, 31])
    mask = torch.where(torch.arange(context)[None] <= pos[:, None], 0.0, torch.finfo(torch.float32).min)
    mask = mask.view(b, 1, 1, context)
    module = FakeAttention()
    ours, _ = packed_sdpa(module, q, k, v, mask, scaling=dim ** -0.5)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim ** -0.5)
    assert ours.shape == stock.shape == (b, 1, kv * groups, dim)
    torch.testing.assert_close(ours, stock)


def _prefix_mask(pos: torch.Tensor, context: int, queries: int = 1) -> torch.Tensor:
    """[b, 1, queries, context] additive: query j of row i sees positions <= pos[i] + j."""
    q = pos.view(-1, 1, 1) + torch.arange(queries).view(1, queries, 1)
    allowed = torch.arange(context).view(1, 1, context) <= q
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min).unsqueeze(1)


@pytest.mark.parametrize("pos", [[4, 20, 9], [4, 1500, 9]], ids=["batched", "row-by-row"])
def test_attention_op_reads_only_what_each_row_can_see(pos: list[int]) -> None:
    """Cache positions a row cannot see are never read: NaN there would poison a full-bucket SDPA (NaN * 0),
    but the op's result is finite and equals attention over the clean buffers. [4, 20, 9] takes one call cut
    to the longest row; [4, 1500, 9] (lengths far apart) one call per row, each over its own length."""
    assert len(segments(tuple(p + 1 for p in pos))) == (1 if pos[1] == 20 else 3)
    torch.manual_seed(1)
    b, kv, groups, context, dim = 3, 2, 3, 2048, 16
    q = torch.randn(b, kv, groups, dim)
    k, v = torch.randn(b, kv, context, dim), torch.randn(b, kv, context, dim)
    mask = _prefix_mask(torch.tensor(pos), context)
    clean = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    longest = max(pos) + 1
    k[:, :, longest:], v[:, :, longest:] = float("nan"), float("nan")
    if pos[1] == 1500:  # row by row: also poison what the short rows cannot see below the longest row
        k[0, :, 5:], v[2, :, 10:] = float("nan"), float("nan")
    assert torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25).isnan().any()
    ours = torch.ops.bucketserve.attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(ours, clean)


def test_rows_are_split_into_runs_by_length() -> None:
    """Similar rows share one call over the longest; a far longer row gets its own call; each run's width is
    its longest row; the runs cover every row in order."""
    assert segments((150,) * 8) == ((0, 8, 150),)
    assert segments((151,) * 7 + (1001,)) == ((0, 7, 151), (7, 8, 1001))
    for extents in [(5, 1501, 10), (1, 900, 900, 3, 2000, 1), (64,) * 16]:
        runs = segments(extents)
        assert [r[0] for r in runs] == [0] + [r[1] for r in runs[:-1]] and runs[-1][1] == len(extents)
        assert all(width == max(extents[a:b]) for a, b, width in runs)


def test_attention_in_runs_reads_only_each_runs_width() -> None:
    """Rows 0-2 short, row 3 long: two calls. NaN beyond each run's width is never read."""
    torch.manual_seed(4)
    pos = [150, 150, 150, 1000]
    assert segments(tuple(p + 1 for p in pos)) == ((0, 3, 151), (3, 4, 1001))
    q, k, v = torch.randn(4, 2, 3, 16), torch.randn(4, 2, 1024, 16), torch.randn(4, 2, 1024, 16)
    mask = _prefix_mask(torch.tensor(pos), 1024)
    clean = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    k[:3, :, 151:], v[3, :, 1001:] = float("nan"), float("nan")
    torch.testing.assert_close(torch.ops.bucketserve.attention(q, k, v, mask, 0.25), clean)


def test_chunk_attention_is_cut_to_the_chunk_end_and_handles_grouped_heads() -> None:
    """A chunk of 4 queries at offset 6 (grouped heads unpacked: 6 query heads over 2 KV heads) reads
    positions 0..9 only and equals SDPA with the K/V heads repeated."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8)
    mask = _prefix_mask(torch.tensor([6]), 32, queries=4)
    clean = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.3)
    k[:, :, 10:] = float("nan")
    torch.testing.assert_close(torch.ops.bucketserve.attention(q, k, v, mask, 0.3), clean)


def test_attention_op_traces_into_a_graph() -> None:
    """The op is opaque to the compiler (static shapes in, same shape out) and gives the eager result."""
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 16, 8), torch.randn(2, 1, 16, 8)
    mask = _prefix_mask(torch.tensor([3, 6]), 16)
    compiled = torch.compile(lambda *a: torch.ops.bucketserve.attention(*a, 0.5), backend="aot_eager",
                             fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, mask), torch.ops.bucketserve.attention(q, k, v, mask, 0.5))
