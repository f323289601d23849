from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from models.attention import packed_sdpa


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
