"""Prompt-lookup speculative decoding end to end on a tiny model: greedy requests carry draft tokens into verify
steps and still produce exactly what transformers' generate produces alone, including when they join, stop or hit
their length inside a verify step; other requests share those steps unchanged; nothing compiles after warm-up."""

from __future__ import annotations

import asyncio
import random

from models.sampling import SamplingParams
from server.engine.engine import Engine
from server.metrics.hooks import NoMetrics
from tests.server.engine.test_engine import collect, solo, started
from tests.support.tiny import tiny_engine, tiny_settings

GREEDY = {"temperature": 0, "ignore_eos": True}


class Drafts(NoMetrics):
    def __init__(self) -> None:
        self.drafts = self.accepted = 0
        self.keys: set[str] = set()

        self.finished: list[tuple[int, int]] = []  # (output tokens, inter-token gaps) of each finished request

    def speculated(self, draft_tokens: int, accepted_tokens: int) -> None:
        self.drafts += draft_tokens
        self.accepted += accepted_tokens

    def request_finished(self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float],
                         finish_reason: str) -> None:
        self.finished.append((output_tokens, len(inter_token)))

    def mixed_done(self, key, decode_rows: int, padding_tokens: int, seconds: float) -> None:
        self.keys.add(key.phase)


def speculating(tmp_path, hooks: Drafts, k: int = 3) -> Engine:
    settings = tiny_settings(compile_backend="dynamo-eager", num_speculative_tokens=k)
    return tiny_engine(tmp_path, settings=settings, metrics=hooks)


def test_greedy_rows_with_drafts_give_the_reference_tokens(tmp_path, reference_model) -> None:
    rng = random.Random(3)
    # Prompts that repeat themselves (drafts match early), and a tiny random model that loops (they match later).
    prompts = [rng.choices(range(10, 400), k=5) * 3 + rng.choices(range(10, 400), k=k) for k in (2, 9, 17, 30)]
    hooks = Drafts()

    async def main() -> tuple[list[list[int]], list[str | None], list[int]]:
        engine = await started(speculating(tmp_path, hooks))
        try:
            assert engine._scheduler.speculative_tokens == 3
            handles = []
            for i, ids in enumerate(prompts):  # staggered: later prompts join steps where others verify drafts
                handles.append(engine.submit(ids, SamplingParams(max_tokens=40 - 7 * i, **GREEDY)))
                await asyncio.sleep(0.02)
            # Beside them, rows that never draft: sampled (seeded) and greedy with logprobs.
            sampled = engine.submit(prompts[0], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
            logprobs = engine.submit(prompts[1], SamplingParams(max_tokens=12, logprobs=2, **GREEDY))
            outs = await asyncio.gather(*(collect(h) for h in [*handles, sampled, logprobs]))
            assert engine.model.accountant.count("serving") == 0  # nothing compiled after warm-up
            # the engine reported its steps' times (buckets/draft_cost.py)
            assert engine._scheduler.draft_cost.steps > 0
            return [t for t, _ in outs], [r for _, r in outs], [len(t) for t, _ in outs]
        finally:
            engine.stop()

    outs, reasons, lengths = asyncio.run(main())
    for i, ids in enumerate(prompts):
        assert outs[i] == solo(reference_model, ids, 40 - 7 * i)
    assert outs[5] == solo(reference_model, prompts[1], 12)
    assert reasons == ["length"] * 6 and lengths[4] == 12
    assert hooks.drafts > 0 and 0 < hooks.accepted <= hooks.drafts
    assert "verify" in hooks.keys
    # one inter-token gap a delivery (a step), as vLLM counts: the accepted drafts arrive with their step
    assert sum(n - 1 - gaps for n, gaps in hooks.finished) == hooks.accepted


def test_a_stop_inside_the_accepted_drafts_ends_the_row_there(tmp_path, reference_model) -> None:
    rng = random.Random(10)  # its reference alternates two tokens, then breaks off
    ids = rng.choices(range(10, 400), k=4) * 4
    reference = solo(reference_model, ids, 30)
    hooks = Drafts()

    async def main() -> list[tuple[tuple[list[int], str | None], int]]:
        engine = await started(speculating(tmp_path, hooks, k=4))
        try:
            results = []
            for cut in (4, 21, 23, 26):  # a stop id first produced at `cut`; then max_tokens that cut drafts short
                stop = reference[cut]
                if stop in reference[:cut]:
                    continue
                handle = engine.submit(ids, SamplingParams(max_tokens=30, stop_token_ids=(stop,), **GREEDY))
                results.append((await collect(handle), cut))
            for n in (1, 2, 5, 11):
                results.append((await collect(engine.submit(ids, SamplingParams(max_tokens=n, **GREEDY))), -n))
            return results
        finally:
            engine.stop()

    for (tokens, reason), cut in asyncio.run(main()):
        if cut >= 0:
            assert (tokens, reason) == (reference[: cut + 1], "stop")
        else:
            assert (tokens, reason) == (reference[:-cut], "length")
    assert hooks.accepted > 0
