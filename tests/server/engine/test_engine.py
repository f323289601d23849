"""Continuous batching in the engine thread, against solo reference runs on a tiny model."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import pytest
import torch

from buckets import BucketTable, PromptTooLongError
from models.sampling import SamplingParams
from server.engine.engine import Engine
from server.engine.interface import QueueFullError
from tests.support.tiny import tiny_engine, tiny_settings


async def collect(handle) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for event in handle:
        if event.token_id is not None:
            tokens.append(event.token_id)
        reason = event.finish_reason
    return tokens, reason


async def started(engine: Engine) -> Engine:
    engine.start()
    deadline = time.monotonic() + 120
    while not engine.is_ready():
        assert engine.is_alive(), engine.progress()
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    return engine


def solo(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=1, eos_token_id=None)
    return out[0, len(ids):].tolist()


def assert_greedy_matches_solo(tmp_path, reference_model, work, table, pause) -> None:
    """Greedy requests submitted with `pause()` seconds between them (joining running batches) produce what
    each produces alone in transformers' generate; every graph compiled at warm-up, none after."""

    async def main() -> list[list[int]]:
        engine = await started(tiny_engine(tmp_path, settings=tiny_settings(compile_backend="dynamo-eager"),
                                           table=table))
        try:
            handles = []
            for ids, n in work:
                handles.append(engine.submit(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)))
                await asyncio.sleep(pause())
            results = await asyncio.gather(*(collect(h) for h in handles))
            assert engine.model.accountant.count("serving") == 0  # zero compilations after warm-up
            assert engine.model.accountant.count("warmup") == engine.table.num_graphs
            if engine.table.mixed_tokens:  # prompts joined running batches: some rode in mixed steps
                assert any(key.phase == "mixed" for key in engine.model.runner.calls)
            return [tokens for tokens, _ in results]
        finally:
            engine.stop()

    outputs = asyncio.run(main())
    for (ids, n), out in zip(work, outputs):
        assert out == solo(reference_model, ids, n)


def test_interleaving_invariance_32_concurrent(tmp_path, reference_model) -> None:
    rng = random.Random(0)
    work = [(rng.choices(range(10, 400), k=rng.randint(1, 60)), rng.randint(1, 40)) for _ in range(32)]
    assert_greedy_matches_solo(tmp_path, reference_model, work, None, lambda: rng.random() * 0.01)


def test_late_request_starts_before_running_ones_finish(tmp_path) -> None:
    async def main() -> None:
        engine = await started(tiny_engine(tmp_path))
        try:
            long_ones = [engine.submit([10 + i] * 5, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
                         for i in range(2)]
            first = asyncio.create_task(collect(long_ones[0]))
            await asyncio.sleep(0.05)
            late = engine.submit([42] * 3, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            tokens, reason = await collect(late)
            assert len(tokens) == 2 and reason == "length"
            assert not first.done()  # the long request is still decoding
            assert engine.num_running() >= 1
            for h in long_ones:
                h.abort()
            await first
        finally:
            engine.stop()

    asyncio.run(main())


def test_abort_frees_slot_within_a_step(tmp_path) -> None:
    async def main() -> None:
        engine = await started(tiny_engine(tmp_path))
        try:
            handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
            it = handle.__aiter__()
            await it.__anext__()
            assert engine.num_running() == 1
            handle.abort("client")
            assert engine.num_running() == 0  # freed at once, before the next step
            rest = [e async for e in it]
            assert rest[-1].finish_reason == "abort"
        finally:
            engine.stop()

    asyncio.run(main())


def test_free_slots_of_a_decode_batch_reach_the_runner_at_position_minus_one(tmp_path) -> None:
    """Three requests decode in batch bucket 4: the fourth row is a free slot, sent at position -1 (the graph
    zeroes it and the CPU kernels skip it); the busy rows at their own positions."""
    table = BucketTable(lengths=(8, 16), batch_sizes=(1, 4), prefill_batch_sizes=(1,), context_length=64)
    seen: list[list[int]] = []

    async def main() -> None:
        engine = await started(tiny_engine(tmp_path, table=table))
        runner = engine.model.runner
        real = runner.decode

        def recording(batch: int, tokens: torch.Tensor, positions: torch.Tensor, kv: int | None = None
                      ) -> torch.Tensor:
            seen.append(positions.tolist())
            return real(batch, tokens, positions, kv)

        runner.decode = recording  # type: ignore[method-assign]
        try:
            handles = [engine.submit([5 + i] * (3 + i), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                       for i in range(3)]
            results = await asyncio.gather(*(collect(h) for h in handles))
            assert [len(tokens) for tokens, _ in results] == [6, 6, 6]
        finally:
            engine.stop()

    asyncio.run(main())
    three = [p for p in seen if len(p) == 4 and sum(x >= 0 for x in p) == 3]
    assert three, seen  # steps with three busy rows in batch 4
    assert all(p[3] == -1 for p in three)
    assert all(x == -1 or x >= 3 for p in seen for x in p)  # a busy row decodes past its prompt


def test_queue_overflow_is_refused_and_admitted_requests_complete(tmp_path) -> None:
    async def main() -> None:
        settings = tiny_settings(max_waiting_requests=2)
        engine = await started(tiny_engine(tmp_path, settings=settings))
        try:
            params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
            admitted, refused = [], 0
            for i in range(12):
                try:
                    admitted.append(engine.submit([5 + i] * 4, params))
                except QueueFullError as exc:
                    refused += 1
                    assert exc.retry_after >= 1
            assert refused > 0
            results = await asyncio.gather(*(collect(h) for h in admitted))
            assert all(len(t) == 30 and r == "length" for t, r in results)
        finally:
            engine.stop()

    asyncio.run(main())


def test_failure_in_one_request_keeps_engine_serving(tmp_path, monkeypatch) -> None:
    async def main() -> None:
        engine = await started(tiny_engine(tmp_path))
        original = engine.model.sampler

        def sampler(params, prompt_ids):
            s = original(params, prompt_ids)
            if prompt_ids[0] == 99:
                def boom(logits):
                    raise RuntimeError("poisoned request")
                s.sample = boom
            return s

        monkeypatch.setattr(engine.model, "sampler", sampler)
        try:
            # A penalty sends the row to the host sampler, which is what the poison replaces.
            bad = engine.submit([99, 5], SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.5))
            good = engine.submit([98, 5], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            (bad_tokens, bad_reason), (good_tokens, good_reason) = await asyncio.gather(collect(bad), collect(good))
            assert bad_reason == "error" and bad_tokens == []
            assert good_reason == "length" and len(good_tokens) == 5
            assert engine.is_alive() and engine.is_ready()
        finally:
            engine.stop()

    asyncio.run(main())


def test_seeded_sampling_is_reproducible_through_the_engine(tmp_path) -> None:
    async def main() -> list[list[int]]:
        engine = await started(tiny_engine(tmp_path))
        try:
            outs = []
            for seed in (1, 1, 2):
                p = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
                outs.append((await collect(engine.submit([5, 6, 7], p)))[0])
            return outs
        finally:
            engine.stop()

    a, b, c = asyncio.run(main())
    assert a == b and a != c


def test_seeded_sampling_does_not_depend_on_the_batch(tmp_path) -> None:
    """The sampling graph's noise comes from (seed, position): sharing a batch changes nothing."""
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=20, seed=42, ignore_eos=True)

    async def main() -> tuple[list[int], list[int]]:
        engine = await started(tiny_engine(tmp_path, settings=tiny_settings(compile_backend="dynamo-eager")))
        try:
            alone = (await collect(engine.submit([5, 6, 7], seeded)))[0]
            noise = [engine.submit([9 + i] * (3 + i), SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
                     for i in range(3)]
            shared = engine.submit([5, 6, 7], seeded)
            results = await asyncio.gather(collect(shared), *(collect(h) for h in noise))
            assert engine.model.accountant.count("serving") == 0
            return alone, results[0][0]
        finally:
            engine.stop()

    alone, shared = asyncio.run(main())
    assert alone == shared and len(alone) == 16


def test_token_ids_outside_the_embedding_table_are_refused(tmp_path) -> None:
    from server.engine.interface import InvalidTokenError

    async def main() -> None:
        engine = await started(tiny_engine(tmp_path))
        try:
            with pytest.raises(InvalidTokenError):
                engine.submit([5, engine.model.vocab_limit], SamplingParams(max_tokens=2))
            tokens, reason = await collect(engine.submit([5, 6], SamplingParams(max_tokens=2, ignore_eos=True)))
            assert len(tokens) == 2 and reason == "length"
        finally:
            engine.stop()

    asyncio.run(main())


CHUNKED_TABLE = BucketTable(lengths=(8, 16), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=128,
                            kv_lengths=(32, 128), chunked_prefill=True)


# The same with mixed steps: prompts ride in decode steps (token buckets 8 and 16), cut at the budget.
MIXED_TABLE = replace(CHUNKED_TABLE, mixed_tokens=(8, 16))


@pytest.mark.parametrize("table", [CHUNKED_TABLE, MIXED_TABLE], ids=["chunk-steps", "mixed-steps"])
def test_chunked_prefill_interleaved_with_decoding_requests_matches_solo_runs(tmp_path, reference_model,
                                                                               table) -> None:
    """Long prompts at chunk boundaries (c - 1 .. 2c + 1 and several chunks) join while others decode."""
    rng = random.Random(7)
    lengths = [15, 16, 17, 32, 33, 70, 3, 9]
    work = [(rng.choices(range(10, 400), k=n), rng.randint(4, 24)) for n in lengths]
    assert_greedy_matches_solo(tmp_path, reference_model, work, table, lambda: 0.01)


@pytest.mark.parametrize("table", [CHUNKED_TABLE, MIXED_TABLE], ids=["chunk-steps", "mixed-steps"])
def test_abort_between_chunks_frees_the_slot_and_leaves_others_unchanged(tmp_path, reference_model, table) -> None:
    rng = random.Random(8)
    other_ids = rng.choices(range(10, 400), k=5)
    long_ids = rng.choices(range(10, 400), k=100)  # 13 chunks of 8

    async def main() -> list[int]:
        settings = tiny_settings(compile_backend="dynamo-eager")
        engine = await started(tiny_engine(tmp_path, settings=settings, table=table))
        try:
            other = engine.submit(other_ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
            it = other.__aiter__()
            first = await it.__anext__()
            long = engine.submit(long_ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
            while engine._scheduler.running.get(1) is None or engine._scheduler.running[1].prefilled == 0:
                await asyncio.sleep(0.001)  # wait until its first chunk is in
            seq = engine._scheduler.running[1]
            assert seq.request_id == long.request_id and 0 < seq.prefilled < len(long_ids)
            long.abort("client")
            assert 1 in engine._scheduler.free_slots() and engine.num_running() == 1
            events = [e async for e in long]
            assert events[-1].finish_reason == "abort" and all(e.token_id is None for e in events)
            return [first.token_id] + [e.token_id for e in [ev async for ev in it] if e.token_id is not None]
        finally:
            engine.stop()

    assert asyncio.run(main()) == solo(reference_model, other_ids, 30)


def test_submit_many_admits_all_or_none(tmp_path) -> None:
    async def main() -> None:
        engine = await started(tiny_engine(tmp_path, settings=tiny_settings(max_waiting_requests=8)))
        try:
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            too_long = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)
            with pytest.raises(PromptTooLongError):  # the third choice does not fit: none is queued
                engine.submit_many([[5] * 4, [6] * 4, [7] * 4], [params, params, too_long], ["a-0", "a-1", "a-2"])
            assert engine.num_waiting() + engine.num_running() == 0
            handles = engine.submit_many([[5] * 4, [6] * 4], [params, params], ["b-0", "b-1"])
            results = await asyncio.gather(*(collect(h) for h in handles))
            assert [len(t) for t, _ in results] == [3, 3]
        finally:
            engine.stop()

    asyncio.run(main())


def test_a_failed_mixed_step_fails_its_prompt_and_the_decoding_rows_go_on(tmp_path, reference_model) -> None:
    rng = random.Random(9)
    decoding_ids, prompt_ids = rng.choices(range(10, 400), k=6), rng.choices(range(10, 400), k=5)

    async def main() -> tuple[list[int], tuple[list[int], str | None]]:
        settings = tiny_settings(compile_backend="dynamo-eager")
        engine = await started(tiny_engine(tmp_path, settings=settings, table=MIXED_TABLE))
        runner = engine.model.runner
        assert runner is not None
        real = runner.mixed

        def fails_once(*args, **kwargs):
            runner.mixed = real  # type: ignore[method-assign]
            raise RuntimeError("mixed step failed")

        try:
            decoding = engine.submit(decoding_ids, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            it = decoding.__aiter__()
            first = await it.__anext__()  # it decodes now: the next prompt rides in a mixed step
            runner.mixed = fails_once  # type: ignore[method-assign]
            failed = await collect(engine.submit(prompt_ids, SamplingParams(max_tokens=3, ignore_eos=True)))
            rest = [e.token_id for e in [ev async for ev in it] if e.token_id is not None]
            assert engine.is_alive() and engine.num_running() == 0
            return [first.token_id, *rest], failed
        finally:
            engine.stop()

    tokens, (failed_tokens, reason) = asyncio.run(main())
    assert failed_tokens == [] and reason == "error"
    assert tokens == solo(reference_model, decoding_ids, 20)  # no token lost or repeated by the failed step


def test_the_waiting_served_ratio_setting_reaches_the_scheduler(tmp_path) -> None:
    engine = tiny_engine(tmp_path, settings=tiny_settings(waiting_served_ratio=0.5))  # unstarted: nothing to stop
    assert engine._scheduler.waiting_served_ratio == 0.5
