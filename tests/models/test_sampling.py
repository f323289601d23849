from __future__ import annotations

import math

import pytest
import torch

from models.params import SamplingError, SamplingParams
from models.sampling import Sampler


def draw(params: SamplingParams, steps: int = 20) -> list[int]:
    gen = torch.Generator().manual_seed(123)
    logits = [torch.randn(50, generator=gen) for _ in range(steps)]
    sampler = Sampler(params, [1, 2, 3])
    return [sampler.sample(row).token_id for row in logits]


def test_same_seed_same_tokens_different_seed_differs() -> None:
    a = draw(SamplingParams(temperature=1.0, seed=7))
    assert a == draw(SamplingParams(temperature=1.0, seed=7))
    assert a != draw(SamplingParams(temperature=1.0, seed=8))


def test_greedy_top_k_top_p_min_p() -> None:
    row = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert Sampler(SamplingParams(temperature=0), []).sample(row).token_id == 1
    for seed in range(20):
        assert Sampler(SamplingParams(top_k=2, seed=seed), []).sample(row).token_id in (1, 2)
        assert Sampler(SamplingParams(top_p=0.01, seed=seed), []).sample(row).token_id == 1
        assert Sampler(SamplingParams(min_p=0.5, seed=seed), []).sample(row).token_id in (1, 2)


def test_penalties_and_logprobs() -> None:
    row = torch.tensor([1.0, 2.0, 0.5])
    # token 1 is in the prompt: a strong repetition penalty moves greedy to token 0.
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=4.0), [1]).sample(row).token_id == 0
    tok = Sampler(SamplingParams(temperature=0, logprobs=2), []).sample(row)
    assert tok.token_id == 1 and tok.top_logprobs[0][0] == 1 and len(tok.top_logprobs) == 2
    assert math.isclose(tok.logprob, float(torch.log_softmax(row, -1)[1]), rel_tol=1e-6)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", float("nan")),
                                          ("max_tokens", 0), ("min_p", 2.0), ("top_k", -1), ("top_k", 2**63),
                                          ("presence_penalty", float("inf")), ("logprobs", 50)])
def test_invalid_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(SamplingError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_vanishing_temperature_is_greedy_not_nan() -> None:
    row = torch.tensor([0.0, 50.0, 49.0])
    assert Sampler(SamplingParams(temperature=1e-40, seed=1), []).sample(row).token_id == 1
    assert Sampler(SamplingParams(temperature=1e-4, seed=1), []).sample(row * 1e6).token_id == 1


def test_only_plain_greedy_rows_take_drafts() -> None:
    """A draft is checked against the row's maximum, so only greedy rows without penalties or logprobs carry them."""
    assert SamplingParams(temperature=0.0).takes_drafts
    assert SamplingParams(temperature=1.0, top_k=1).takes_drafts  # greedy by top_k
    assert not SamplingParams(temperature=1.0).takes_drafts
    assert not SamplingParams(temperature=0.0, presence_penalty=0.5).takes_drafts
    assert not SamplingParams(temperature=0.0, repetition_penalty=1.2).takes_drafts
    assert not SamplingParams(temperature=0.0, logprobs=0).takes_drafts
