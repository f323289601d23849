"""A step's sampling (server/engine/step_sampling.py): the all-greedy path picks what argmax picks, and a
failed sampling graph fails no row the host can sample."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from buckets.scheduler import Sequence
from models import native
from models.params import SamplingParams
from models.runner import ModelRunner
from models.sampling import SampledToken, Sampler
from server.engine.step_sampling import StepLogits, greedy_ids, sample_step


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
    was = native.enabled()
    native.configure(False)  # --no-native-kernels (and devices other than the CPU): torch.max's indices
    try:
        assert native.argmax(logits) is None
        assert greedy_ids(logits) == ids
    finally:
        native.configure(was)


class _FailingGraph:
    """A runner whose sampling graph fails for the whole batch."""

    table = SimpleNamespace(sample_batch_sizes=(1, 4))

    def sample(self, logits: torch.Tensor, rows: object) -> tuple[torch.Tensor, ...]:
        raise RuntimeError("graph failed")


class _BrokenSampler(Sampler):
    def sample(self, logits: torch.Tensor) -> SampledToken:
        raise ValueError("this row cannot be sampled")


def test_a_failed_sampling_graph_fails_no_row_the_host_can_sample() -> None:
    """The batch's graph failing (it used to fail every sampling row of the step: one request's top_k past int64
    did) sends the rows to the host path: each request gets its token there, or its own error."""
    logits = torch.randn(4, 50)
    logits[0, 7] = logits[1, 9] = 100.0
    seqs = tuple(cast(Sequence, SimpleNamespace(prompt_len=3, num_generated=i)) for i in range(3))
    samplers: list[Sampler | None] = [Sampler(SamplingParams(temperature=0.5, seed=1), [1, 2, 3]),
                                      Sampler(SamplingParams(temperature=0.0, logprobs=2), [1, 2, 3]),
                                      _BrokenSampler(SamplingParams(temperature=0.7, seed=2), [1, 2, 3])]
    out = sample_step(cast(ModelRunner, _FailingGraph()), seqs, samplers, StepLogits(logits, [0, 1, 2]))
    assert isinstance(out[0], SampledToken) and out[0].token_id == 7
    assert isinstance(out[1], SampledToken) and out[1].token_id == 9 and len(out[1].top_logprobs) == 2
    assert isinstance(out[2], ValueError)


class _ArgmaxGraph:
    """A runner whose sampling graph gives each row's maximum, and records the rows it was given."""

    table = SimpleNamespace(sample_batch_sizes=(1, 4, 8, 16))

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, list[object]]] = []

    def sample(self, logits: torch.Tensor, rows: list[object]) -> tuple[torch.Tensor, ...]:
        self.calls.append((logits.clone(), list(rows)))
        r = logits.shape[0]
        return (logits.argmax(dim=-1), torch.zeros(r), torch.zeros(r, 20, dtype=torch.long), torch.zeros(r, 20),
                torch.zeros(r, dtype=torch.bool))


def test_the_sampling_graph_gets_only_the_rows_that_need_it() -> None:
    """A step of 16 rows of logits with two sampled requests runs the graph on those two rows (the 4-row bucket),
    each with its own parameters; a greedy request of the step takes its row's maximum."""
    logits = torch.randn(16, 50)
    for r, t in ((3, 11), (11, 22), (5, 33)):
        logits[r, t] = 100.0
    seqs = tuple(cast(Sequence, SimpleNamespace(prompt_len=3, num_generated=i)) for i in range(3))
    samplers: list[Sampler | None] = [Sampler(SamplingParams(temperature=0.5, seed=1), [1]),
                                      Sampler(SamplingParams(temperature=0.0), [1]),
                                      Sampler(SamplingParams(temperature=0.9, top_p=0.5, seed=2), [1])]
    graph = _ArgmaxGraph()
    out = sample_step(cast(ModelRunner, graph), seqs, samplers, StepLogits(logits, [3, 5, 11]))
    assert [o.token_id for o in out if isinstance(o, SampledToken)] == [11, 33, 22]
    (given, rows), = graph.calls
    assert given.shape == (4, 50) and torch.equal(given[0], logits[3]) and torch.equal(given[1], logits[11])
    assert rows[0] == (0.5, 0, 1.0, 0.0, samplers[0].seed, 3) and rows[1] == (0.9, 0, 0.5, 0.0, samplers[2].seed, 5)
    assert rows[2:] == [None, None]
