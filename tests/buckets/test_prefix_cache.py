"""Prefix caching in the scheduler, driven without a model: which slot a prompt takes, where its prefill starts,
and what a freed slot is said to hold."""

from __future__ import annotations

import pytest

from buckets import BucketTable
from buckets.prefix_cache import MIN_MATCH, SlotPrefixes, best_match, common_prefix
from buckets.scheduler import DecodeStep, MixedStep, PrefillStep, Scheduler, Sequence

TABLE = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                    chunked_prefill=True, mixed_tokens=(8, 16, 32, 64))


def seq(rid: str, ids: list[int], max_tokens: int = 3) -> Sequence:
    return Sequence(rid, len(ids), max_tokens, prompt_ids=tuple(ids))


def drain(s: Scheduler, tokens: dict[str, list[int]] | None = None) -> list[object]:
    """Run steps until nothing is left; request r samples tokens[r] in order (else 900, 901, ...)."""
    steps: list[object] = []
    counts: dict[str, int] = {}
    while (step := s.schedule()) is not None:
        sampled = {}
        for q in step.sampling_seqs:
            i = counts.get(q.request_id, 0)
            counts[q.request_id] = i + 1
            own = (tokens or {}).get(q.request_id)
            sampled[q.request_id] = own[i] if own and i < len(own) else 900 + i
        s.update(step, sampled)
        steps.append(step)
    return steps


def pieces(step: object) -> list[tuple[str, int, int, int]]:
    assert isinstance(step, MixedStep)
    return [(p.seq.request_id, p.seq.slot, p.offset, p.num_tokens) for p in step.pieces]


def test_common_prefix() -> None:
    assert common_prefix((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((), (1,)) == 0
    assert common_prefix(tuple(range(100)) + (7,), tuple(range(100)) + (8,)) == 100


def test_best_match_rules() -> None:
    long = tuple(range(50))
    held = {0: long[:20], 1: long[:30], 2: long[:30], 3: (99,) + long[1:30]}  # 3 differs at the first token
    assert best_match(long, held, prefer=0) == (1, 30)  # the longest; the lowest slot on a tie
    assert best_match(long, held, prefer=2) == (2, 30)  # ... unless the prompt's own slot ties: no copy
    assert best_match(long, {0: long[:20], 3: held[3]}, prefer=3) == (0, 20)
    assert best_match(long[:20], {0: long[:20]}, prefer=1) == (0, 19)  # the last prompt token always runs
    assert best_match(long[:MIN_MATCH], {0: long}, prefer=0) == (-1, 0)  # 15 tokens: not worth a copy
    assert best_match(long, {}, prefer=0) == (-1, 0)


def test_slot_records() -> None:
    p = SlotPrefixes(limit=40)
    long = tuple(range(50))
    p.release(1, long[:30])
    assert p.source(long, 0, [1, 2], {}) == (1, 30)
    p.forget(1)
    assert p.source(long, 0, [1, 2], {}) == (-1, 0)
    p.release(4, long)
    assert p.held[4] == long[:40]  # the limit: position context - 1 is not claimed
    p.release(4, ())
    assert 4 not in p.held
    running = Sequence("r", 50, 5, prompt_ids=long, prefilled=25)  # mid-prompt: what it has computed so far
    assert p.source(long, 0, [], {3: running}) == (3, 25)
    assert p.source((), 0, [], {3: running}) == (-1, 0)
    with pytest.raises(ValueError):
        SlotPrefixes(limit=0)


def test_a_repeated_prompt_starts_where_the_freed_slot_match_ends() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    prompt = list(range(1, 41))
    s.add(seq("a", prompt))
    drain(s)
    assert s.free_slots() == [0, 1, 2, 3]
    s.add(seq("b", prompt))
    step = s.schedule()
    # Nothing decodes and 40 tokens fit a prefill bucket, but a prefill starts at position 0: a mixed step
    # carries the one token the slot does not hold.
    assert isinstance(step, MixedStep) and step.tokens == 8
    assert pieces(step) == [("b", 0, 39, 1)]
    assert step.pieces[0].seq.cached == 39
    s.update(step, {"b": 5})
    assert s.running[0].is_decoding


def test_a_match_in_another_slot_is_copied_into_the_lowest_free_one() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    shared = list(range(1, 33))
    s.add_many([seq("x", [70 + i for i in range(20)], max_tokens=1), seq("y", shared + [5, 6], max_tokens=1)])
    drain(s)  # x in slot 0, y in slot 1
    s.add(seq("z", shared + [7, 8, 9]))
    step = s.schedule()
    # slot 1 holds the 32 shared tokens: z takes slot 0 (small decode buckets), its 32 positions copied over
    assert pieces(step) == [("z", 0, 32, 3)]
    assert isinstance(step, MixedStep) and step.copies == ((1, 0, 32),)
    s.update(step, {"z": 4})
    assert s._prefixes is not None and s._prefixes.held == {1: tuple(shared + [5, 6])}  # the source keeps its own
    drain(s)
    assert s.running == {}


def test_a_running_request_shares_what_it_has_computed() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    system = list(range(1, 31))
    s.add(seq("first", system + [40, 41], max_tokens=10))
    s.update(s.schedule(), {"first": 5})  # first decodes in slot 0
    s.add(seq("second", system + [50, 51, 52]))
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.copies == ((0, 1, 30),)
    assert pieces(step) == [("second", 1, 30, 3)]
    s.update(step, {"first": 6, "second": 7})
    s.abort("second")
    s.discard(step.pieces[0].seq)  # as the engine does for a failed step: the copy may not have happened
    assert s._prefixes is not None and 1 not in s._prefixes.held


def test_the_freed_slot_holds_the_prompt_and_all_but_the_last_sampled_token() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    turn1 = list(range(1, 25))
    s.add(seq("t1", turn1, max_tokens=4))
    drain(s, {"t1": [31, 32, 33, 34]})
    assert s._prefixes is not None and s._prefixes.held[0] == tuple(turn1 + [31, 32, 33])
    # The next turn repeats the conversation (and the reply) and adds to it: all of it but the new part is reused.
    turn2 = turn1 + [31, 32, 33, 34, 40, 41]
    s.add(seq("t2", turn2))
    step = s.schedule()
    assert pieces(step) == [("t2", 0, 27, 3)]


def test_an_aborted_prompt_leaves_only_what_was_prefilled() -> None:
    table = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=128,
                        chunked_prefill=True, mixed_tokens=(8, 16, 32))
    s = Scheduler(table, prefix_caching=True, waiting_served_ratio=0)  # the mixed budget while d decodes
    s.add(seq("d", [9] * 5, max_tokens=20))
    s.update(s.schedule(), {"d": 1})  # d decodes in slot 0: the mixed budget (16) from now on
    long = list(range(100, 160))
    s.add(seq("long", long))
    step = s.schedule()
    assert pieces(step) == [("long", 1, 0, 15)]
    s.update(step, {"d": 1})
    step = s.schedule()
    assert pieces(step) == [("long", 1, 15, 15)]
    s.update(step, {"d": 1})
    s.abort("long")
    assert s._prefixes is not None and s._prefixes.held[1] == tuple(long[:30])
    s.add(seq("again", long))
    step = s.schedule()
    assert pieces(step) == [("again", 1, 30, 15)]


def test_a_running_slot_and_a_prefill_step_claim_nothing() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    s.add(seq("a", list(range(1, 21)), max_tokens=1))
    drain(s)
    s.add(seq("b", [60 + i for i in range(10)]))  # no match: a prefill step into slot 0, which it overwrites
    step = s.schedule()
    assert isinstance(step, PrefillStep) and step.seqs[0].slot == 0
    assert s._prefixes is not None and 0 not in s._prefixes.held


def test_off_by_default_and_only_with_mixed_steps() -> None:
    s = Scheduler(TABLE)
    prompt = list(range(1, 41))
    s.add(seq("a", prompt))
    drain(s)
    s.add(seq("b", prompt))
    step = s.schedule()
    assert pieces(step) == [("b", 0, 0, 32)] and step.seqs[0].cached == 0  # from position 0 (32 + 8 tokens)
    plain = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=64)
    with pytest.raises(ValueError, match="mixed steps"):
        Scheduler(plain, prefix_caching=True)
    with pytest.raises(ValueError, match="prompt ids"):
        Scheduler(TABLE).add(Sequence("c", 3, 1, prompt_ids=(1, 2)))


def test_a_decode_step_ends_the_records_of_its_free_rows() -> None:
    """A decode step computes its free rows at position 0 of their slots: those slots no longer hold their
    records' first position."""
    s = Scheduler(TABLE, prefix_caching=True)
    s.add_many([seq("a", list(range(1, 25)), max_tokens=1), seq("b", list(range(30, 50)), max_tokens=8)])
    while not isinstance(step := s.schedule(), DecodeStep):  # mixed steps prefill both; a ends in slot 0
        s.update(step, {q.request_id: 3 for q in step.sampling_seqs})
    assert 0 not in s.running and s.running[1].request_id == "b" and step.batch == 2
    assert s._prefixes is not None and 0 not in s._prefixes.held
    s.add(seq("again", list(range(1, 25))))
    assert pieces(s.schedule()) == [("again", 0, 0, 24)]  # computed again from position 0


def _freed_in(s: Scheduler, rid: str, ids: list[int]) -> int:
    """Run request `rid` (one token) beside whatever runs, to its end; the slot it leaves its record in."""
    s.add(seq(rid, ids, max_tokens=1))
    slot = -1
    while slot < 0 or slot in s.running:  # mixed steps, as many as its prompt takes beside the running rows
        step = s.schedule()
        assert isinstance(step, MixedStep)
        slot = next((p.seq.slot for p in step.pieces if p.seq.request_id == rid), slot)
        s.update(step, {q.request_id: 7 for q in step.sampling_seqs})
    assert s._prefixes is not None and slot in s._prefixes.held and s._prefixes is not None and slot in s._prefixes.held
    return slot


def test_a_prompt_without_a_match_keeps_the_records_it_can() -> None:
    """Slots 0 and 1 run long requests, so slots 2 and 3 share the next decode bucket (4). A conversation ends in
    slot 2; a prompt that matches nothing then takes empty slot 3, not the lowest, and the conversation's next
    turn finds its record in slot 2 and takes that slot (no copy)."""
    s = Scheduler(TABLE, prefix_caching=True)
    s.add_many([seq("run0", [90] * 4, max_tokens=50), seq("run1", [91] * 4, max_tokens=50)])
    s.update(s.schedule(), {"run0": 1, "run1": 1})
    chat = list(range(1, 21))
    assert _freed_in(s, "chat", chat) == 2
    s.add(seq("other", [60 + i for i in range(20)], max_tokens=5))
    step = s.schedule()
    assert [p[:2] for p in pieces(step)] == [("other", 3)]
    s.update(step, {"run0": 1, "run1": 1, "other": 1})
    s.add(seq("chat2", chat + [7, 8, 9]))
    step = s.schedule()
    assert isinstance(step, MixedStep) and ("chat2", 2, 20, 3) in pieces(step) and step.copies == ()


def test_the_record_freed_longest_ago_is_overwritten_first() -> None:
    s = Scheduler(TABLE, prefix_caching=True)
    s.add_many([seq("run0", [90] * 4, max_tokens=50), seq("run1", [91] * 4, max_tokens=50)])
    s.update(s.schedule(), {"run0": 1, "run1": 1})
    old = list(range(1, 21))
    assert _freed_in(s, "old", old) == 2
    assert _freed_in(s, "new", list(range(30, 50))) == 3  # slot 2 holds a record: the empty slot 3
    assert _freed_in(s, "third", list(range(60, 80))) == 2  # both hold one: old's, freed longest ago, goes
    assert s._prefixes is not None and set(s._prefixes.held) == {2, 3}
    s.add(seq("new again", list(range(30, 50)) + [5]))
    step = s.schedule()
    assert pieces(step) == [("new again", 3, 20, 1)]  # new's record survived; it is reused in place


def test_victim_prefers_an_empty_slot_then_the_oldest_record() -> None:
    p = SlotPrefixes(limit=64)
    assert p.victim([2, 5]) == 2
    p.release(5, (1, 2))
    p.release(2, (3, 4))
    assert p.victim([2, 5, 7]) == 7
    assert p.victim([2, 5]) == 5
    p.release(5, (1, 2, 3))  # freed again: now the newest
    assert p.victim([2, 5]) == 2
