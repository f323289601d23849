"""Prefix caching end to end on a tiny model: prompts that begin with what a freed slot holds skip that part of
their prefill, and still produce exactly what transformers' generate produces for the whole prompt; the served
answer and /metrics say how many prompt tokens were reused."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from models.sampling import SamplingParams
from server.engine.engine import Engine
from tests.server.engine.test_engine import collect, solo, started
from tests.support.served import NO_EOS, serve
from tests.support.tiny import build_tiny_checkpoint, tiny_engine, tiny_settings

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_reused_prefixes_give_the_reference_tokens(tmp_path, reference_model) -> None:
    rng = random.Random(1)
    system = rng.choices(range(10, 400), k=30)  # a shared "system prompt"
    first = system + rng.choices(range(10, 400), k=6)

    async def ask(engine: Engine, ids: list[int], n: int) -> tuple[list[int], int]:
        handle = engine.submit(ids, SamplingParams(max_tokens=n, **GREEDY))
        tokens, reason = await collect(handle)
        assert reason == "length"
        return tokens, handle.cached_tokens

    copies: list[tuple[int, int, int]] = []

    async def main() -> list[tuple[list[int], list[int], int]]:
        engine = await started(tiny_engine(tmp_path, settings=tiny_settings(compile_backend="dynamo-eager")))
        runner = engine.model.runner
        copy = runner.copy_prefix

        def recorded(source: int, target: int, n: int) -> None:
            copies.append((source, target, n))
            copy(source, target, n)

        runner.copy_prefix = recorded
        try:
            assert engine._scheduler.prefix_caching
            runs = []
            out, cached = await ask(engine, first, 8)
            runs.append((first, out, cached))
            again = list(first)  # the same prompt: all but its last token reused
            runs.append((again, *await ask(engine, again, 8)))
            turn2 = first + out + rng.choices(range(10, 400), k=5)  # the conversation goes on
            runs.append((turn2, *await ask(engine, turn2, 6)))
            other = system + rng.choices(range(10, 400), k=9)  # the system prompt alone matches
            runs.append((other, *await ask(engine, other, 5)))
            # Several at once: the first reuses slot 0 in place, the others copy its first 30 positions (the
            # copies run before the step that computes the rest).
            batch = [system + rng.choices(range(10, 400), k=k) for k in (3, 11, 20)]
            handles = [engine.submit(ids, SamplingParams(max_tokens=7, **GREEDY)) for ids in batch]
            outs = await asyncio.gather(*(collect(h) for h in handles))
            runs += [(ids, toks, h.cached_tokens) for ids, (toks, _), h in zip(batch, outs, handles)]
            assert engine.model.accountant.count("serving") == 0  # nothing compiled after warm-up
            return runs
        finally:
            engine.stop()

    runs = asyncio.run(main())
    for ids, out, _ in runs:
        assert out == solo(reference_model, ids, len(out))
    cached = [c for _, _, c in runs]
    assert cached[0] == 0
    assert cached[1] == len(first) - 1
    assert cached[2] == len(first) + len(runs[0][1]) - 1  # the prompt and every answer token but the last
    assert cached[3] == len(system)
    assert cached[4:] == [len(system)] * 3
    assert copies == [(0, 1, len(system)), (0, 2, len(system))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(Path(tmp_path_factory.mktemp("prefix-served")) / "tiny-llama")


def test_served_usage_and_metrics_count_the_reused_tokens(checkpoint: str) -> None:
    prompt = list(range(20, 60))
    with serve(tiny_settings(model=checkpoint, compile_backend="dynamo-eager")) as live:
        before = live.scrape()
        bodies = []
        for stream in (False, True, False):
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, **NO_EOS}
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            if stream:
                lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
                usage = httpx.Response(200, content=lines[-1]).json()["usage"]
            else:
                usage = r.json()["usage"]
            bodies.append(usage)
        after = live.scrape()
        # n choices and prompt lists: each prompt's cached tokens count once, as its prompt tokens do
        many = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "n": 2, "max_tokens": 3, "temperature": 0, **NO_EOS}).json()["usage"]
        listed = httpx.post(live.url + "/v1/completions", timeout=60, json={
            "prompt": [prompt, list(range(100, 130))], "max_tokens": 3, "temperature": 0, **NO_EOS}).json()["usage"]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in bodies] == [0, 39, 39]
    assert all(u["prompt_tokens"] == 40 for u in bodies)
    assert many["prompt_tokens"] == 40 and many["prompt_tokens_details"]["cached_tokens"] == 39
    assert listed["prompt_tokens"] == 70 and listed["prompt_tokens_details"]["cached_tokens"] == 39

    def delta(name: str) -> float:
        return (after.get(name) or 0.0) - (before.get(name) or 0.0)

    assert delta("bucketserve_prefix_cache_queries_total") == 3 * 40
    assert delta("bucketserve_prefix_cache_hits_total") == 2 * 39


def test_a_slot_a_decode_step_ran_as_a_free_row_is_not_reused(tmp_path, reference_model) -> None:
    """A decode step computes its free rows at position 0 of their slots (models/step_functions.py): a record
    that still claimed that slot's position 0 would hand a later prompt a clobbered first position."""
    rng = random.Random(2)
    short = rng.choices(range(10, 400), k=24)
    long = rng.choices(range(10, 400), k=20)

    async def main() -> tuple[list[int], int]:
        engine = await started(tiny_engine(tmp_path, settings=tiny_settings(compile_backend="dynamo-eager")))
        try:
            first = engine.submit(short, SamplingParams(max_tokens=2, **GREEDY))  # slot 0, done after a step
            other = engine.submit(long, SamplingParams(max_tokens=40, **GREEDY))  # slot 1, decodes on: batch 2
            it = other.__aiter__()
            await collect(first)
            for _ in range(6):  # decode steps run with slot 0 free
                await it.__anext__()
            again = engine.submit(short, SamplingParams(max_tokens=6, **GREEDY))
            tokens, _ = await collect(again)
            other.abort()
            return tokens, again.cached_tokens
        finally:
            engine.stop()

    tokens, cached = asyncio.run(main())
    assert tokens == solo(reference_model, short, 6)
    assert cached == 0  # slot 0's record went with the decode step that wrote it


@pytest.mark.parametrize("overrides", [{"batching": "static", "prefill_chunk_size": 0}, {"mixed_steps": False},
                                       {"enable_prefix_caching": False}])
def test_off_without_mixed_steps_or_when_asked(tmp_path, overrides) -> None:
    engine = tiny_engine(tmp_path, settings=tiny_settings(**overrides))
    assert not engine._scheduler.prefix_caching
    assert tiny_engine(tmp_path / "on", settings=tiny_settings())._scheduler.prefix_caching
