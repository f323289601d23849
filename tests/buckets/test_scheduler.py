"""The scheduler's policy, driven without a model: the engine's two calls, simulated."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from buckets import BucketTable, PromptTooLongError
from buckets.scheduler import (
    WAITING_SERVED_RATIO,
    ChunkStep,
    DecodeStep,
    MixedStep,
    PrefillStep,
    QueueFullError,
    Scheduler,
    Sequence,
)

TABLE = BucketTable(lengths=(8, 16, 32), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=64)


def seq(rid: str, n: int, max_tokens: int = 4, stop: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(rid, n, max_tokens, stop)


def run_step(s: Scheduler, token: int = 7) -> tuple[object, list[Sequence]]:
    step = s.schedule()
    assert step is not None
    return step, s.update(step, {q.request_id: token for q in step.seqs})


def test_prefill_groups_same_bucket_and_uses_lowest_slots() -> None:
    s = Scheduler(TABLE)
    s.add(seq("a", 5))
    s.add(seq("b", 20))
    s.add(seq("c", 7))
    step = s.schedule()
    assert isinstance(step, PrefillStep)
    assert step.length == 8 and step.batch == 2
    assert [q.request_id for q in step.seqs] == ["a", "c"] and [q.slot for q in step.seqs] == [0, 1]
    assert step.padding_tokens == (8 - 5) + (8 - 7)


def test_prefill_and_decode_alternate_so_nothing_starves() -> None:
    s = Scheduler(TABLE)
    s.add(seq("a", 5, max_tokens=10))
    kinds = []
    for i in range(6):
        if i < 4:
            s.add(seq(f"n{i}", 20, max_tokens=10))
        step, _ = run_step(s)
        kinds.append(type(step).__name__)
    assert kinds[:4] == ["PrefillStep", "DecodeStep", "PrefillStep", "DecodeStep"]


def test_decode_batch_covers_highest_busy_slot_and_finish_frees_slot() -> None:
    s = Scheduler(TABLE)
    for rid, mt in (("a", 1), ("b", 5), ("c", 5)):
        s.add(seq(rid, 3, max_tokens=mt))
    step, finished = run_step(s)  # prefill a, b in slots 0, 1 ; a finishes (max_tokens 1)
    assert [q.request_id for q in finished] == ["a"] and 0 not in s.running
    step, _ = run_step(s)  # decode b (slot 1) -> batch 2; c waits one step (alternation)
    assert isinstance(step, DecodeStep) and step.batch == 2 and step.padding_rows == 1
    step, _ = run_step(s)  # prefill c into the freed slot 0
    assert isinstance(step, PrefillStep) and step.seqs[0].slot == 0


def test_stop_token_length_and_positions() -> None:
    s = Scheduler(TABLE)
    s.add(seq("a", 3, max_tokens=5, stop=frozenset({9})))
    step, _ = run_step(s, token=1)
    q = step.seqs[0]
    assert q.position == 3 and q.num_generated == 1
    run_step(s, token=1)
    assert q.position == 4
    _, finished = run_step(s, token=9)
    assert finished == [q] and q.finish_reason == "stop"


def test_abort_waiting_and_running() -> None:
    s = Scheduler(TABLE)
    s.add(seq("a", 3, 10))
    s.add(seq("b", 3, 10))
    s.add(seq("c", 3, 10))
    run_step(s)
    assert s.abort("a") is not None and 0 not in s.running
    assert s.abort("c") is not None and s.num_waiting == 0 and s.waiting_tokens == 0
    assert s.abort("zzz") is None


def test_admission_limits() -> None:
    s = Scheduler(TABLE, max_waiting_requests=2, max_waiting_tokens=40)
    s.add(seq("a", 30))
    with pytest.raises(QueueFullError) as err:
        s.add(seq("b", 20))
    assert err.value.reason == "tokens"
    s.add(seq("c", 10))
    with pytest.raises(QueueFullError, match="2 requests"):
        s.add(seq("d", 1))
    with pytest.raises(PromptTooLongError):
        s.add(seq("e", 33))
    with pytest.raises(PromptTooLongError):
        s.add(seq("f", 30, max_tokens=40))


def test_add_many_is_all_or_none_and_checks_sizes_first() -> None:
    s = Scheduler(TABLE, max_waiting_requests=3, max_waiting_tokens=100)
    s.add(seq("a", 5))
    with pytest.raises(QueueFullError, match="3 requests"):  # the third of three does not fit
        s.add_many([seq("b", 5), seq("c", 5), seq("d", 5)])
    assert s.num_waiting == 1 and s.waiting_tokens == 5
    with pytest.raises(PromptTooLongError):  # too long is reported as such, not as a full queue
        s.add_many([seq("e", 5), seq("f", 5), seq("g", 5), seq("h", 33)])
    assert s.num_waiting == 1
    s.add_many([seq("b", 5), seq("c", 5)])
    assert [q.request_id for q in s.waiting] == ["a", "b", "c"] and s.waiting_tokens == 15


def run_all(s: Scheduler, seqs: list[Sequence], check: Callable[[object], None]) -> list[str]:
    """Queue `seqs`, run the scheduler until idle (one token per sampling row), check each step; every request
    must finish with all its tokens. Returns request ids in the order their prompts started."""
    for q in seqs:
        s.add(q)
    started: list[str] = []
    done: set[str] = set()
    for _ in range(10_000):
        step = s.schedule()
        if step is None:
            break
        new = step.seqs if isinstance(step, PrefillStep) else \
            [p.seq for p in step.pieces if p.offset == 0] if isinstance(step, MixedStep) else []
        started += [q.request_id for q in new]
        check(step)
        done |= {q.request_id for q in s.update(step, {q.request_id: 1 for q in step.sampling_seqs})}
    assert done == {q.request_id for q in seqs}
    assert all(q.num_generated == q.max_tokens for q in seqs)
    return started


def test_random_workload_is_fcfs_and_completes() -> None:
    rng = random.Random(0)
    s = Scheduler(TABLE, max_waiting_requests=1000, max_waiting_tokens=10**6)
    seqs = [seq(f"r{i}", rng.randint(1, 32), rng.randint(1, 20)) for i in range(60)]

    def check(step: object) -> None:
        assert len({q.slot for q in s.running.values()}) == len(s.running) <= TABLE.max_batch

    started = run_all(s, seqs, check)
    # FCFS per bucket: within one length bucket, requests start in arrival order.
    for bucket in TABLE.lengths:
        order = [r for r in started if next(q for q in seqs if q.request_id == r).bucket == bucket]
        assert order == [q.request_id for q in seqs if q.bucket == bucket]


def test_static_policy_runs_batches_to_completion() -> None:
    s = Scheduler(TABLE, policy="static")
    s.add(seq("a", 3, max_tokens=3))
    s.add(seq("b", 3, max_tokens=3))
    step, _ = run_step(s)
    assert isinstance(step, PrefillStep) and len(step.seqs) == 2
    step, _ = run_step(s)
    assert isinstance(step, DecodeStep)
    s.add(seq("late", 3, max_tokens=1))
    kinds = []
    while (step := s.schedule()) is not None:
        kinds.append((type(step).__name__, [q.request_id for q in step.seqs]))
        s.update(step, {q.request_id: 1 for q in step.seqs})
    # The late request waits until the running batch has finished, unlike continuous batching.
    assert kinds == [("DecodeStep", ["a", "b"]), ("PrefillStep", ["late"])]
    with pytest.raises(ValueError):
        Scheduler(TABLE, policy="fifo")


def test_decode_kv_bucket_covers_longest_live_row_and_shrinks_when_it_finishes() -> None:
    table = BucketTable(lengths=(4, 8), batch_sizes=(1, 2), prefill_batch_sizes=(1, 2), context_length=32,
                        kv_lengths=(8, 16, 32))
    s = Scheduler(table)
    s.add(seq("long", 8, max_tokens=12))
    s.add(seq("short", 2, max_tokens=20))
    run_step(s)  # prefill both (bucket 8 and 4 differ: only "long" joins this prefill)
    run_step(s)  # decode "long": its first token goes to position 8 -> 9 positions -> KV 16
    kvs = []
    while (step := s.schedule()) is not None:
        if isinstance(step, DecodeStep):  # checked before update() moves the positions on
            longest = max(q.position for q in step.seqs) + 1
            assert step.kv == table.kv_for(longest) and step.kv >= longest
            kvs.append((step.kv, sorted(q.request_id for q in step.seqs)))
        s.update(step, {q.request_id: 7 for q in step.seqs})
    # While "long" runs the step pays for its length; once it finishes, "short" decodes in a smaller bucket.
    assert (16, ["long", "short"]) in kvs
    last_with_long = max(i for i, (_, ids) in enumerate(kvs) if "long" in ids)
    assert kvs[last_with_long][0] == 32 and kvs[last_with_long + 1] == (16, ["short"])


CHUNKED = BucketTable(lengths=(4, 8), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=64,
                      kv_lengths=(16, 32, 64), chunked_prefill=True)


def drive(s: Scheduler, limit: int = 200) -> list[tuple[str, tuple[str, ...]]]:
    """Run the scheduler to idle; returns (step kind, request ids) per step."""
    out = []
    while (step := s.schedule()) is not None and len(out) < limit:
        out.append((type(step).__name__, tuple(q.request_id for q in step.seqs)))
        s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    return out


def test_long_prompt_is_prefilled_in_chunks_and_yields_its_token_at_the_last() -> None:
    s = Scheduler(CHUNKED)
    long = seq("long", 21, max_tokens=2)  # chunks of 8: [0, 8) prefill, [8, 16) and [16, 21) chunk steps
    s.add(long)
    assert long.bucket == 24  # rounded up to a multiple of the chunk length
    first = s.schedule()
    assert isinstance(first, PrefillStep) and first.length == 8 and first.sampling_seqs == ()
    s.update(first, {})
    assert long.prefilled == 8 and long.num_generated == 0
    second = s.schedule()
    assert isinstance(second, ChunkStep) and (second.offset, second.num_tokens, second.kv) == (8, 8, 16)
    assert not second.is_final
    s.update(second, {})
    third = s.schedule()
    assert isinstance(third, ChunkStep) and (third.offset, third.num_tokens, third.kv) == (16, 5, 32)
    assert third.is_final and third.padding_tokens == 3
    s.update(third, {"long": 9})
    assert long.is_decoding and long.last_token == 9 and long.position == 21 and long.num_chunks == 3


def test_never_two_chunks_in_a_row_while_a_row_decodes() -> None:
    s = Scheduler(CHUNKED)
    s.add(seq("short", 3, max_tokens=30))
    s.add(seq("long", 60, max_tokens=2))
    steps = drive(s)
    kinds = [k for k, _ in steps]
    decoding_short = [i for i, (k, ids) in enumerate(steps) if k == "DecodeStep" and "short" in ids]
    for i in range(1, len(steps)):
        both_prefill = kinds[i] != "DecodeStep" and kinds[i - 1] != "DecodeStep"
        assert not (both_prefill and decoding_short and decoding_short[0] < i < decoding_short[-1])
    assert kinds.count("ChunkStep") == 7  # 60 tokens: one prefill of 8, then 7 chunks
    # The short request was decoding throughout: every chunk has a decode step right after it.
    for i, kind in enumerate(kinds[:-1]):
        if kind == "ChunkStep" and decoding_short[-1] > i:
            assert kinds[i + 1] == "DecodeStep"


def test_the_chunking_request_goes_before_later_arrivals() -> None:
    s = Scheduler(CHUNKED)
    s.add(seq("long", 30, max_tokens=2))
    s.add(seq("short", 3, max_tokens=5))
    s.update(s.schedule(), {})  # first chunk of "long" into slot 0
    step = s.schedule()  # FCFS: the chunking request, older than "short", goes on first
    assert isinstance(step, ChunkStep)
    s.update(step, {})
    step = s.schedule()
    assert isinstance(step, ChunkStep)  # still nothing decodes, chunks continue back to back
    s.update(step, {})
    step = s.schedule()
    assert isinstance(step, ChunkStep) and step.is_final
    s.update(step, {"long": 5})
    step = s.schedule()  # "long" decodes its second (last) token, then "short" takes the freed slot 0
    assert isinstance(step, DecodeStep) and [q.request_id for q in step.seqs] == ["long"]
    s.update(step, {"long": 6})
    step = s.schedule()
    assert isinstance(step, PrefillStep) and step.seqs[0].request_id == "short" and step.seqs[0].slot == 0


def test_parked_rows_and_abort_between_chunks() -> None:
    s = Scheduler(CHUNKED)
    s.add(seq("once", 3, max_tokens=1))
    s.add(seq("short", 3, max_tokens=20))
    s.update(s.schedule(), {"once": 5, "short": 5})  # both prefilled; "once" ends, "short" decodes in slot 1
    long = seq("long", 40, max_tokens=2)
    s.add(long)
    parked_seen = 0
    for _ in range(5):  # decode, prefill (first chunk), decode, chunk, decode
        step = s.schedule()
        if isinstance(step, DecodeStep):
            assert [q.request_id for q in step.seqs] == ["short"] and step.batch == 2  # chunking rows never decode
            if long.slot == 0:  # inside the batch: its dummy row writes where its next chunk will write first
                assert step.parked == ((0, long.prefilled),)
                parked_seen += 1
        s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    assert parked_seen == 2 and long.slot == 0 and 0 < long.prefilled < 40
    assert s.abort("long") is long and 0 in s.free_slots()  # aborted between chunks: the slot is free at once
    assert not any(isinstance(s.schedule(), ChunkStep) for _ in range(3))


MIXED = BucketTable(lengths=(8, 16), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=64,
                    chunked_prefill=True, mixed_tokens=(8, 16))


def test_prompts_ride_in_decode_steps_up_to_the_token_budget() -> None:
    s = Scheduler(MIXED)
    s.add(seq("a", 5, max_tokens=8))
    first = s.schedule()
    assert isinstance(first, PrefillStep)  # nothing decodes yet: a plain prefill of its own bucket
    s.update(first, {"a": 7})
    s.add_many([seq("b", 6), seq("c", 12), seq("d", 3)])
    step = s.schedule()
    # a decodes (1 token), b whole (6), c's first 9 tokens fill the budget of 16; d waits
    assert isinstance(step, MixedStep) and step.tokens == 16
    assert [q.request_id for q in step.decode] == ["a"]
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("b", 0, 6), ("c", 0, 9)]
    assert [q.request_id for q in step.sampling_seqs] == ["a", "b"] and step.padding_tokens == 0
    assert [q.slot for q in step.seqs] == [0, 1, 2] and s.num_waiting == 1
    s.update(step, {"a": 7, "b": 7})
    step = s.schedule()
    # c's last 3 tokens come first (the cut prompt goes on at once), then d whole into the last slot
    assert isinstance(step, MixedStep) and step.tokens == 8
    assert [q.request_id for q in step.decode] == ["a", "b"]
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("c", 9, 3), ("d", 0, 3)]
    assert step.padding_tokens == 8 - 2 - 6
    s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    assert s.num_decoding == 4 and all(q.prefilled == q.prompt_len for q in s.running.values())
    assert isinstance(s.schedule(), DecodeStep)  # no prompt work left: a plain decode step


# Token buckets past the chunk length (16): solo steps, run only while no row decodes.
SOLO = BucketTable(lengths=(8, 16), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                   chunked_prefill=True, mixed_tokens=(8, 16, 32, 64))


def test_a_long_prompt_at_an_idle_server_takes_solo_steps() -> None:
    assert (SOLO.mixed_budget, SOLO.solo_budget) == (16, 64)
    s = Scheduler(SOLO, waiting_served_ratio=0)  # the solo budget only while nothing decodes
    s.add(seq("long", 100, max_tokens=8))
    step = s.schedule()
    # nothing decodes: a mixed step of the solo budget starts the prompt (no prefill of its first chunk)
    assert isinstance(step, MixedStep) and step.tokens == 64 and not step.decode and not step.sampling_seqs
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("long", 0, 64)]
    s.update(step, {})
    step = s.schedule()  # still nothing decodes: the other 36 tokens, 32 of them (a 64 would be half padding)
    assert isinstance(step, MixedStep) and step.tokens == 32 and not step.decode
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("long", 64, 32)]
    s.update(step, {})
    step = s.schedule()  # and the last 4 in an 8
    assert isinstance(step, MixedStep) and step.tokens == 8 and step.padding_tokens == 4
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("long", 96, 4)]
    s.update(step, {"long": 7})
    s.add_many([seq("short", 5), seq("next", 30)])
    step = s.schedule()
    # a row decodes now: the mixed budget of 16 again (1 decoding row + 5 + the first 10 of "next")
    assert isinstance(step, MixedStep) and step.tokens == 16 and len(step.decode) == 1
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("short", 0, 5), ("next", 0, 10)]


# Token buckets of 8, 16 and 32 with a budget of 32 (the chunk length) while rows decode.
TRIM = BucketTable(lengths=(8, 32), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                   chunked_prefill=True, mixed_tokens=(8, 16, 32))


def test_a_mixed_step_stops_at_the_bucket_below_where_its_own_would_be_mostly_padding() -> None:
    s = Scheduler(TRIM)
    s.add(seq("a", 5, max_tokens=8))
    s.update(s.schedule(), {"a": 7})  # "a" decodes
    s.add(seq("b", 19))
    step = s.schedule()
    # 1 row + 19 tokens = 20 would take the 32 bucket: 16 now (1 + 15), b's other 4 + the row in an 8 next
    assert isinstance(step, MixedStep) and step.tokens == 16 and step.padding_tokens == 0
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("b", 0, 15)]
    s.update(step, {"a": 7})
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.tokens == 8 and [q.request_id for q in step.decode] == ["a"]
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("b", 15, 4)]
    s.update(step, {"a": 7, "b": 7})
    s.add(seq("c", 26))
    step = s.schedule()
    # 2 rows + 26 = 28: a 16 now would leave 12 + 2 rows for another 16: 32 tokens either way, so one 32 step
    assert isinstance(step, MixedStep) and step.tokens == 32
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("c", 0, 26)]


def test_a_short_prompt_at_an_idle_server_takes_two_mixed_steps_where_they_pad_less_than_its_prefill() -> None:
    s = Scheduler(TRIM)
    s.add(seq("a", 18, max_tokens=2))  # its prefill pads to 32; mixed steps of 16 + 8 run 24 tokens
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.tokens == 16 and not step.sampling_seqs
    s.update(step, {})
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.tokens == 8
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("a", 16, 2)]
    assert [q.request_id for q in step.sampling_seqs] == ["a"]
    s.update(step, {"a": 7})
    s.update(s.schedule(), {"a": 7})  # a decode step finishes it
    s.add(seq("b", 28))  # 16 + 16 would run as many tokens as its 32 prefill: the prefill
    step = s.schedule()
    assert isinstance(step, PrefillStep) and step.length == 32


def test_trimmed_workload_completes_fcfs_with_at_most_one_prompt_cut() -> None:
    rng = random.Random(3)
    s = Scheduler(TRIM, max_waiting_requests=1000, max_waiting_tokens=10**6)
    seqs = [seq(f"r{i}", rng.randint(1, 100), rng.randint(1, 12)) for i in range(60)]

    def check(step: object) -> None:
        if isinstance(step, MixedStep):
            assert len(step.decode) + step.prompt_tokens <= step.tokens
            assert sum(1 for q in s.running.values() if 0 < q.prefilled < q.prompt_len) <= 1

    assert run_all(s, seqs, check) == [q.request_id for q in seqs]


def test_short_prompts_at_an_idle_server_keep_their_prefill() -> None:
    s = Scheduler(SOLO)
    s.add_many([seq("a", 12), seq("b", 40)])
    step = s.schedule()  # the head fits a length bucket: its own prefill, no token padding
    assert isinstance(step, PrefillStep) and step.length == 16 and [q.request_id for q in step.seqs] == ["a"]


def _one_decoding_row_and(s: Scheduler, waiting: list[Sequence]) -> MixedStep:
    """Row "a" decodes, then `waiting` queue: the next step, which must be a mixed step."""
    s.add(seq("a", 5, max_tokens=8))
    first = s.schedule()
    assert isinstance(first, PrefillStep)
    s.update(first, {"a": 7})
    s.add_many(waiting)
    step = s.schedule()
    assert isinstance(step, MixedStep) and [q.request_id for q in step.decode] == ["a"]
    return step


def test_waiting_served_ratio_off_keeps_the_mixed_budget_while_a_row_decodes() -> None:
    s = Scheduler(SOLO, waiting_served_ratio=0)
    step = _one_decoding_row_and(s, [seq("b", 30), seq("c", 30)])
    assert step.tokens == SOLO.mixed_budget == 16 and step.prompt_tokens == 15


def test_waiting_served_ratio_is_one_by_default() -> None:
    """As many prompts that could start as rows decode: the solo budget (docs/performance.md, session 46)."""
    assert Scheduler(SOLO).waiting_served_ratio == WAITING_SERVED_RATIO == 1.0
    step = _one_decoding_row_and(Scheduler(SOLO), [seq("b", 30), seq("c", 30)])
    assert step.tokens == SOLO.solo_budget and step.prompt_tokens == 60


@pytest.mark.parametrize(("ratio", "waiting", "solo"), [
    (1.0, 1, True),  # one startable prompt against one decoding row: 1 >= 1 x 1
    (2.0, 1, False),  # 1 < 2 x 1
    (2.0, 2, True),
    (0.05, 1, True),  # nearly always (vLLM's one budget)
    (0.0, 5, False),  # 0: off
])
def test_waiting_served_ratio_gives_the_solo_budget_when_the_waiting_outnumber_the_decoding(
        ratio: float, waiting: int, solo: bool) -> None:
    s = Scheduler(SOLO, waiting_served_ratio=ratio)
    step = _one_decoding_row_and(s, [seq(f"w{i}", 40) for i in range(waiting)])
    if solo:  # the decoding row and as many prompt tokens as the largest token bucket holds (one prompt of 40
        # and the row would fill 41 of 64: 32 of them now, the rest with the row in a 16 next)
        assert step.tokens == (64 if waiting > 1 else 32) and step.prompt_tokens == step.tokens - 1
    else:
        assert step.tokens == SOLO.mixed_budget and step.prompt_tokens == 15


def test_waiting_served_ratio_counts_only_prompts_that_can_start() -> None:
    # 4 slots: "a" decodes, "b" and "c" fill two more; four more wait but one slot is free: 1 startable < 1 x 3
    s = Scheduler(SOLO, waiting_served_ratio=1.0)
    step = _one_decoding_row_and(s, [seq("b", 3), seq("c", 3)])
    s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    step = s.schedule()
    assert isinstance(step, DecodeStep) and len(step.seqs) == 3
    s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    s.add_many([seq(f"w{i}", 30) for i in range(4)])
    step = s.schedule()
    assert isinstance(step, MixedStep) and len(step.decode) == 3 and step.tokens == SOLO.mixed_budget


def test_waiting_served_ratio_counts_a_prompt_mid_chunk_as_waiting() -> None:
    for ratio, tokens in ((0.0, 16), (1.0, 64)):
        s = Scheduler(SOLO, waiting_served_ratio=0)  # off while "long" starts: one decoding row, its first 15 tokens
        step = _one_decoding_row_and(s, [seq("long", 100)])
        s.update(step, {"a": 7})
        s.waiting_served_ratio = ratio  # then: "long" mid-chunk is one waiting stream against one decoding row
        step = s.schedule()
        assert isinstance(step, MixedStep) and [q.request_id for q in step.decode] == ["a"], ratio
        assert step.tokens == tokens and [(p.seq.request_id, p.offset) for p in step.pieces] == [("long", 15)]


def test_waiting_served_ratio_must_be_a_number_at_least_zero() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="waiting_served_ratio"):
            Scheduler(SOLO, waiting_served_ratio=bad)


def test_solo_workload_completes_fcfs_and_never_stalls_decoding_rows_past_the_budget() -> None:
    rng = random.Random(2)
    s = Scheduler(SOLO, max_waiting_requests=1000, max_waiting_tokens=10**6, waiting_served_ratio=0)
    seqs = [seq(f"r{i}", rng.randint(1, 100), rng.randint(1, 12)) for i in range(50)]
    solo_steps = []

    def check(step: object) -> None:
        if isinstance(step, MixedStep):
            assert len(step.decode) + step.prompt_tokens <= step.tokens <= SOLO.solo_budget
            if step.decode:
                assert step.tokens <= SOLO.mixed_budget  # rows decode: one chunk at most
            else:
                solo_steps.append(step.tokens)

    assert run_all(s, seqs, check) == [q.request_id for q in seqs]
    assert solo_steps and max(solo_steps) > SOLO.mixed_budget


def test_mixed_workload_completes_fcfs_with_every_token() -> None:
    rng = random.Random(1)
    s = Scheduler(MIXED, max_waiting_requests=1000, max_waiting_tokens=10**6)
    seqs = [seq(f"r{i}", rng.randint(1, 40), rng.randint(1, 12)) for i in range(50)]

    def check(step: object) -> None:
        if isinstance(step, MixedStep):
            assert len(step.decode) + step.prompt_tokens <= step.tokens <= MIXED.mixed_budget
            assert sum(1 for q in s.running.values() if 0 < q.prefilled < q.prompt_len) <= 1

    assert run_all(s, seqs, check) == [q.request_id for q in seqs]  # one queue, served in arrival order


def test_a_short_prompt_starts_beside_a_long_one_mid_chunk() -> None:
    """A waiting prompt that fits whole in half a mixed step's prompt budget starts beside a prompt mid-chunk that
    would take the whole budget, instead of waiting for its last chunk; the long prompt keeps the rest."""
    s = Scheduler(MIXED)  # budget 16: one decoding row and 15 prompt tokens
    step = _one_decoding_row_and(s, [seq("long", 40), seq("short", 5), seq("eight", 8)])
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("long", 0, 15)]  # FCFS start
    s.update(step, {"a": 7})
    step = s.schedule()
    assert isinstance(step, MixedStep)
    # "short" (5 <= 15 // 2) starts whole; "eight" (8 > the 2 tokens left of the half) waits; "long" takes the rest
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("short", 0, 5), ("long", 15, 10)]
    s.update(step, {"a": 7, "short": 7})
    step = s.schedule()
    assert isinstance(step, MixedStep)
    # two rows decode (budget 14): "eight" is more than half of it and waits; "long" takes it all
    assert [(p.seq.request_id, p.offset, p.num_tokens) for p in step.pieces] == [("long", 25, 14)]
