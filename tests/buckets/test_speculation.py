"""Speculative decoding without a model: the n-gram drafts, what a verify step accepts, and how the scheduler
carries drafts (verify steps, their token buckets, rows that stop or reach their length inside one)."""

from __future__ import annotations

import pytest

from buckets import BucketError, BucketTable, GraphKey
from buckets.scheduler import DecodeStep, MixedStep, Scheduler, Sequence
from buckets.speculation import FILL_DRAFTS_MOST, NgramIndex, accepted, fill_drafts, plan_drafts

TABLE = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                    mixed_tokens=(8, 16, 32, 64), draft_rows=8)


def test_ngram_drafts_follow_the_latest_longest_match() -> None:
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    assert index.propose(2) == (7,)  # "2 3" last occurred before 7 ("5 2 3" never did): a short match, one draft
    assert index.propose(0) == ()
    index.append(7)
    assert index.propose(3) == (8, 5, 2)  # "2 3 7" matches: a full match, k drafts
    index.append(4)  # "3 7 4", "7 4", "4": never seen
    assert index.propose(3) == ()
    assert NgramIndex([1, 2, 3, 1, 2, 3]).propose(5) == (1, 2, 3)  # a draft stops at the end of the tokens
    assert NgramIndex([5, 6, 5]).propose(4) == (6,)
    assert NgramIndex([]).propose(2) == () and NgramIndex([3]).propose(2) == ()


def test_accepted_stops_at_the_first_wrong_draft() -> None:
    assert accepted(5, (), []) == [5]
    assert accepted(5, (5, 6, 7), [6, 7, 8]) == [5, 6, 7, 8]  # every draft right: one more token
    assert accepted(5, (5, 9, 7), [6, 7, 8]) == [5, 6]
    assert accepted(5, (4, 6, 7), [6, 7, 8]) == [5]


def test_plan_drafts_limits() -> None:
    rows = [Sequence(f"r{i}", 6, 10, ngrams=NgramIndex([1, 2, 3, 1, 2, 3])) for i in range(3)]
    for r in rows:
        r.prefilled, r.position = 6, 6
    rows[1].ngrams = None  # a row that does not speculate
    rows[2].num_generated = 8  # two tokens left: one draft
    assert plan_drafts(tuple(rows), 3, room=8, context_length=128) == ((1, 2, 3), (), (1,))
    assert plan_drafts(tuple(rows), 3, room=4, context_length=128) == ((1, 2, 3), (), (1,))
    assert plan_drafts(tuple(rows), 3, room=2, context_length=128) == ((1, 2), (), ())
    assert plan_drafts(tuple(rows[:1]), 3, room=8, context_length=8) == ((1,),)  # the context's last position
    assert plan_drafts(tuple(rows[1:2]), 3, room=8, context_length=128) == ()


def test_the_table_has_a_verify_graph_per_mixed_bucket() -> None:
    keys = list(TABLE.graph_keys())
    assert [k for k in keys if k.phase == "verify"] == [GraphKey("verify", 12, n) for n in (8, 16, 32, 64)]
    assert TABLE.num_graphs == len(keys)
    assert BucketTable.from_dict(TABLE.to_dict()) == TABLE
    assert GraphKey("verify", 12, 16).bucket == "t16"
    # Below the smallest mixed bucket (the CPU default's 32), small verify buckets for a few rows and their drafts;
    # above the mixed budget none (a step with decoding rows carries at most that).
    cpu = BucketTable(lengths=(32, 64, 128, 256), batch_sizes=(1, 4, 16), context_length=512,
                      mixed_tokens=(32, 64, 128, 256, 512), max_step_tokens=128, draft_rows=48)
    assert cpu.verify_tokens == (8, 16, 32, 64, 128) and cpu.verify_rows == 64
    assert (cpu.verify_for(3), cpu.verify_for(9), cpu.verify_for(64)) == (8, 16, 64)
    for bad in (-1, 61, True):
        with pytest.raises(BucketError, match="draft_rows"):
            BucketTable(lengths=(8, 64), batch_sizes=(4,), mixed_tokens=(8, 64), draft_rows=bad)
    with pytest.raises(BucketError, match="draft_rows"):
        BucketTable(lengths=(8, 64), batch_sizes=(4,), draft_rows=2)  # no mixed steps
    with pytest.raises(ValueError, match="verify graphs"):
        Scheduler(BucketTable(lengths=(8, 64), batch_sizes=(4,), mixed_tokens=(8, 64)), speculative_tokens=2)


def speculating(rid: str, prompt: list[int], max_tokens: int = 20, stop: frozenset[int] = frozenset()) -> Sequence:
    return Sequence(rid, len(prompt), max_tokens, stop, ngrams=NgramIndex(prompt))


def test_decoding_rows_with_drafts_take_verify_steps() -> None:
    s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0)  # a prompt joins the drafts, not a big step
    a, b = speculating("a", [1, 2, 3, 1, 2, 3, 1, 2]), Sequence("b", 5, 20)  # b does not speculate
    s.add(a)
    s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]
    s.add(b)
    step = s.schedule()
    # a's last tokens "2 3" occurred before "1 2 3": drafts (1, 2, 3) beside b's prompt: 4 + 5 tokens -> bucket 16
    assert isinstance(step, MixedStep) and step.drafts == ((1, 2, 3),) and step.pieces[0].num_tokens == 5
    assert step.tokens == 16 and step.padding_tokens == 7 and step.num_drafts == 3
    s.update(step, {"a": [1, 2, 3, 1], "b": 50})  # every draft accepted, and the token after them
    assert (a.num_generated, a.position, a.last_token) == (5, 12, 1)
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.drafts == ((2, 3, 1), ()) and not step.pieces  # a verify step
    assert step.tokens == 8 and step.padding_tokens == 3  # a's 4 tokens and b's one
    s.update(step, {"a": [2, 9], "b": 51})  # one draft accepted, then a token of its own
    assert (a.num_generated, a.position, a.last_token) == (7, 14, 9)
    assert (b.num_generated, b.position) == (2, 6)
    assert a.ngrams is not None and a.ngrams.tokens[-4:] == [3, 1, 2, 9]
    assert isinstance(s.schedule(), DecodeStep)  # "2 9", "9": never seen before: no drafts, a plain decode step


def test_a_stop_or_the_length_inside_a_verify_step_ends_the_row_there() -> None:
    s = Scheduler(TABLE, speculative_tokens=3)
    a = speculating("a", [1, 2, 3, 1, 2, 3, 1, 2], stop=frozenset({7}))
    c = speculating("c", [4, 5, 4, 5, 4, 5, 4, 5], max_tokens=3)
    s.add(a)
    s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]
    s.add(c)
    s.update(s.schedule(), {"a": [1], "c": 4})  # type: ignore[arg-type]  # a's drafts all wrong: one token
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.drafts == ((2, 3, 1), (5,))  # c: 2 tokens left, 1 draft
    finished = s.update(step, {"a": [2, 7, 1, 2], "c": [5, 4]})
    assert finished == [a, c]
    assert (a.finish_reason, a.num_generated, a.last_token) == ("stop", 4, 7)  # the tokens after the stop: dropped
    assert (c.finish_reason, c.num_generated) == ("length", 3)
    assert s.running == {}


@pytest.mark.parametrize(("prompt", "drafts", "tokens"), [
    (28, (1, 2, 3), 32),  # room for both: a's 3 drafts and the whole prompt (1 + 3 + 28 tokens)
    (61, (1, 2), 64),  # the prompt first: a's drafts take the 2 tokens it leaves
    (62, (1,), 64),
    (63, (), 64),  # nothing left: a decodes one token beside the prompt
])
def test_drafts_get_what_the_prompts_leave_of_the_budget(prompt: int, drafts: tuple[int, ...], tokens: int) -> None:
    """In a mixed step a prompt token is work some request needs, a draft only a guess: the prompts that can start
    take the budget (64) first, the drafts what they leave (docs/performance.md, session 48)."""
    s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0)
    a = speculating("a", [1, 2, 3, 1, 2, 3, 1, 2])
    s.add(a)
    s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]
    s.add(Sequence("p", prompt, 4))
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.drafts == ((drafts,) if drafts else ())
    assert step.pieces[0].num_tokens == prompt and step.tokens == tokens


def test_fill_drafts_fills_the_bucket_the_rows_take_anyway() -> None:
    cases = ((1, 8), (2, 8), (3, 16), (4, 16), (5, 32), (1, 64), (16, 64))  # (rows, token bucket), K = 3
    assert [fill_drafts(3, rows, tokens) for rows, tokens in cases] == [7, 0, 4, 0, 5, FILL_DRAFTS_MOST, 0]
    assert fill_drafts(5, 4, 16) == 0  # no more than K: each row keeps its own limit


def test_a_lone_row_fills_its_verify_bucket_with_drafts_and_keeps_k_beside_a_prompt() -> None:
    s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0)
    a = speculating("a", list(range(1, 11)) + [1, 2])
    s.add(a)
    s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]  # "1 2 3" occurred at the start: 4 .. 10 follow
    step = s.schedule()
    assert isinstance(step, MixedStep) and not step.pieces
    assert step.drafts == ((4, 5, 6, 7, 8, 9, 10),) and step.tokens == 8  # the bucket 1 + 3 tokens take anyway
    s.add(Sequence("b", 5, 20))
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.drafts == ((4, 5, 6),) and step.pieces[0].num_tokens == 5


def test_a_row_that_accepts_every_draft_carries_more_and_one_that_does_not_fewer() -> None:
    index = NgramIndex([1, 2, 3])
    assert index.limit(3) == 3
    index.verified(3, 3, k=3)
    assert index.limit(3) == 5
    index.verified(5, 5, k=3)
    index.verified(7, 7, k=3)
    assert index.limit(3) == FILL_DRAFTS_MOST  # at the most
    index.verified(8, 2, k=3)
    assert index.limit(3) == FILL_DRAFTS_MOST - 1
    for _ in range(10):
        index.verified(1, 0, k=3)
    assert index.limit(3) == 1  # never below one


def test_the_scheduler_adapts_each_rows_drafts_to_what_it_accepted() -> None:
    s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0)
    a = speculating("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], max_tokens=40)
    b = speculating("b", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=40)
    s.add_many([a, b])
    s.update(s.schedule(), {"a": 3, "b": 7})  # type: ignore[arg-type]
    step = s.schedule()  # two rows in an 8-token bucket: K each
    assert isinstance(step, MixedStep) and step.drafts == ((4, 5, 6), (5, 6, 7))
    s.update(step, {"a": [4, 5, 6, 7], "b": [9]})  # a: every draft; b: none
    assert a.ngrams is not None and b.ngrams is not None and (a.ngrams.limit(3), b.ngrams.limit(3)) == (5, 2)
    step = s.schedule()
    assert isinstance(step, MixedStep) and step.drafts[0] == (8, 9, 1, 2, 3)


def test_a_rows_acceptance_counts_its_verify_results_and_the_drafts_it_would_have_carried() -> None:
    index = NgramIndex([1, 2, 3, 1, 2])
    assert index.acceptance == 0.5  # the prior: one accepted, one rejected
    index.verified(3, 3, k=3)  # all accepted: three hits, no miss
    assert index.acceptance == pytest.approx((0.7 + 3) / (0.7 + 3 + 0.7))
    index.verified(3, 1, k=3)  # one accepted, then the rejected one
    assert (index.hits, index.misses) == (pytest.approx(3.7 * 0.7 + 1), pytest.approx(0.7 * 0.7 + 1))
    before = index.acceptance
    index.observe(3)  # would have drafted 3 after "1 2": held
    index.append(3)
    assert index.acceptance > before
    before = index.acceptance
    index.observe(9)  # would have drafted 1 after "2 3": did not hold
    index.append(9)
    assert index.acceptance < before
    unmatched = NgramIndex([4, 5])
    unmatched.observe(6)  # no draft to offer: nothing learned
    assert unmatched.acceptance == 0.5


def test_a_row_carries_the_drafts_whose_chance_is_above_the_threshold() -> None:
    index = NgramIndex([1, 2, 3])  # acceptance 0.5: draft i yields a token with chance 0.5**i
    assert [index.worth(t, 3) for t in (0.0, 0.2, 0.3, 0.49, 0.5, 0.9)] == [3, 2, 1, 1, 0, 0]
    assert index.worth(0.001, 8) == 8 and index.worth(0.2, 0) == 0
    index.hits, index.misses = 1.0, 0.0  # every draft accepted so far
    assert index.worth(0.99, 5) == 5
    rows = [Sequence(f"r{i}", 6, 10, ngrams=NgramIndex([1, 2, 3, 1, 2, 3])) for i in range(2)]
    for r in rows:
        r.prefilled, r.position = 6, 6
    assert rows[0].ngrams is not None
    rows[0].ngrams.hits = 9.0  # acceptance 0.9
    assert plan_drafts(tuple(rows), 3, room=8, context_length=128, threshold=0.6) == ((1, 2, 3), ())
    assert plan_drafts(tuple(rows), 3, room=8, context_length=128, threshold=0.4) == ((1, 2, 3), (1,))
    assert plan_drafts(tuple(rows), 3, room=8, context_length=128, threshold=0.95) == ()
