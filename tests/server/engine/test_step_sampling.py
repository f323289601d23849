"""The all-greedy path of a step's sampling (server/engine/step_sampling.py) picks what argmax picks."""

from __future__ import annotations

import pytest
import torch

from server.engine.step_sampling import greedy_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_ids_equal_argmax_with_ties_and_nans(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 49152).to(dtype)
    logits[1, [7, 300, 40000]] = 50.0  # a three-way tie: the first
    logits[2, :] = 0.0  # all equal: token 0
    logits[3, [5, 9]] = float("nan")  # NaN wins, the first one
    logits[4, [100, 101]] = float("inf")
    logits[5, 49151] = 99.0  # the last token
    ids = greedy_ids(logits)
    assert ids == logits.argmax(dim=-1).tolist()
    assert ids[1:] == [7, 0, 5, 100, 49151]
