"""The engine asks the float32 head for each row's maximum alone (models/greedy_head.py) exactly when a step's
tokens are all greedy and nothing else reads its logits: greedy requests still match transformers' generate, and a
request that wants logprobs beside them gets real ones."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import server.engine.model as engine_model
from models import greedy_head, native_matmul
from models.prepack import _PACKED
from models.sampling import SamplingParams
from server.compose import build_model, engine_for
from tests.server.engine.test_engine import solo, started
from tests.support.tiny import build_tiny_checkpoint, tiny_settings

pytestmark = pytest.mark.skipif(not greedy_head.available(), reason="needs the native kernels with AVX2 and FMA")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose vocabulary (416) is a multiple of 32, so its fp32 head gets the tile and screen copies."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("head") / "tiny", vocab_words=396)


def run(checkpoint: str, monkeypatch: pytest.MonkeyPatch, work: list[tuple[list[int], SamplingParams]]
        ) -> tuple[list[list[int]], list[list[tuple[int, float]]], list[bool]]:
    """Serves `work` at once; returns each request's tokens, its per-token top logprobs, and each step's `maxima`."""
    asked: list[bool] = []
    real = engine_model.maxima_only

    @contextmanager
    def spy(on: bool = True) -> Iterator[None]:
        asked.append(on)
        with real(on):
            yield

    monkeypatch.setattr(engine_model, "maxima_only", spy)

    async def main() -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
        s = tiny_settings()
        engine = await started(engine_for(s, build_model(s, checkpoint), None))
        try:
            head = engine.model.runner.model.get_output_embeddings()
            entry = _PACKED[head.weight.data_ptr()]
            assert entry.few is not None and entry.few[0] == native_matmul.GREEDY_HEAD_F32
            handles = [engine.submit(ids, p) for ids, p in work]
            out = []
            for h in handles:
                tokens, tops = [], []
                async for event in h:
                    if event.token_id is not None:
                        tokens.append(event.token_id)
                        tops.append(list(event.top_logprobs))
                out.append((tokens, tops))
            return out
        finally:
            engine.stop()

    results = asyncio.run(main())
    return [t for t, _ in results], [tops for _, tops in results], asked


def greedy(n: int, **extra: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra)  # type: ignore[arg-type]


def test_greedy_steps_ask_for_maxima_and_match_generate(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    work = [([7, 8, 9, 10], 12), ([100, 200, 300], 9), (list(range(20, 45)), 7)]
    tokens, _, asked = run(checkpoint, monkeypatch, [(ids, greedy(n)) for ids, n in work])
    assert asked and all(asked)
    for (ids, n), got in zip(work, tokens):
        assert got == solo(reference, ids, n)


def test_a_logprobs_request_gets_the_full_logits(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [11, 12, 13, 14, 15]
    alone_tokens, alone_tops, alone_asked = run(checkpoint, monkeypatch, [(ids, greedy(6, logprobs=3))])
    assert alone_asked and not any(alone_asked)
    work = [([7, 8, 9, 10], 10), (ids, greedy(6, logprobs=3)), ([100, 200, 300], 10)]
    tokens, tops, asked = run(checkpoint, monkeypatch, [(i, p if isinstance(p, SamplingParams) else greedy(p))
                                                        for i, p in work])
    assert False in asked  # the steps that carried the logprobs request
    assert tokens[1] == alone_tokens[0]
    for got, want in zip(tops[1], alone_tops[0]):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(lp > float("-inf") for _, lp in got)
        assert torch.allclose(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]), atol=1e-5)
