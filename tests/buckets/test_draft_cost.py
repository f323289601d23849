"""Cost-aware drafts without a model: the step-time line fitted from observed steps, the acceptance rate, the
goodput rule, and the scheduler leaving drafts out where they do not pay (and in where they do)."""

from __future__ import annotations

import pytest

from buckets import BucketTable
from buckets.draft_cost import PRIOR_ACCEPTANCE, DraftCost
from buckets.scheduler import DecodeStep, MixedStep, Piece, Scheduler, Sequence
from buckets.speculation import NgramIndex

TABLE = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                    mixed_tokens=(8, 16, 32, 64), draft_rows=8)


def _decode(rows: int) -> DecodeStep:
    seqs = tuple(Sequence(f"r{i}", 4, 8, slot=i, position=4) for i in range(rows))
    return DecodeStep(TABLE.batch_for(max(rows, 1)), TABLE.context_length, seqs)


def _fed(a: float, b: float, accepted: int, drafted: int, sizes: tuple[int, ...] = (1, 2, 4)) -> DraftCost:
    """A DraftCost that saw decode steps of `sizes` rows take a + b * rows seconds, and verify rows accept
    `accepted` of `drafted` drafts."""
    cost = DraftCost()
    for _ in range(10):
        for rows in sizes:
            cost.observe(_decode(rows), a + b * rows)
    cost.verified(drafted, accepted)
    return cost


def test_the_line_is_fitted_from_the_steps_seen() -> None:
    cost = _fed(0.040, 0.0035, 1, 3)
    line = cost.line()
    assert line is not None
    assert line[0] == pytest.approx(0.040) and line[1] == pytest.approx(0.0035)
    assert cost.acceptance == pytest.approx(1 / 3)


def test_one_size_alone_gives_no_line_and_drafts_run_until_measured() -> None:
    cost = DraftCost()
    assert cost.line() is None and cost.acceptance == PRIOR_ACCEPTANCE and cost.pays(64)  # nothing seen
    for _ in range(20):
        cost.observe(_decode(4), 0.08)
    assert cost.line() is None and cost.pays(64)  # no slope from steps of one size
    cost = _fed(0.040, 0.0035, 0, 0)  # a line, but no verify step yet: its acceptance is not known
    assert cost.line() is not None and cost.pays(64)


def test_drafts_pay_where_a_token_costs_little_beside_the_step() -> None:
    """p (a + b n) > b n: fp32 on 256-bit FMAs (~40 ms a step, ~3.5 ms a token, a third of drafts accepted) pays
    up to ~5 tokens; a memory-bound bf16 step (~0.6 ms a token of ~35) at 16 rows and more."""
    fp32 = _fed(0.040, 0.0035, 1, 3)
    assert [fp32.pays(n) for n in (1, 4, 5, 6, 8, 16)] == [True, True, True, False, False, False]
    bf16 = _fed(0.035, 0.0006, 1, 3)
    assert bf16.pays(16) and bf16.pays(24) and not bf16.pays(40)
    free = _fed(0.040, 0.0, 1, 3)
    assert free.pays(1000)  # a token costs nothing more: drafts are free


def test_recent_steps_weigh_more() -> None:
    """The line follows the machine: after a slower spell the fit moves to it."""
    cost = _fed(0.040, 0.001, 1, 2)
    for _ in range(300):
        for rows in (1, 2, 4):
            cost.observe(_decode(rows), 0.040 + 0.004 * rows)
    line = cost.line()
    assert line is not None and line[1] == pytest.approx(0.004, rel=1e-3)
    for _ in range(300):
        cost.verified(4, 0)
    assert cost.acceptance < 0.01


def test_only_steps_of_decoding_rows_are_observed() -> None:
    """A mixed step with a prompt piece would tilt the line (a piece's attention): it is left out; a verify step
    of decoding rows alone counts its rows and drafts."""
    cost = DraftCost()
    row = Sequence("a", 8, 8, slot=0, position=8)
    prompt = Sequence("p", 20, 8, slot=1)
    cost.observe(MixedStep(32, (row,), (Piece(prompt, 0, 20),)), 0.5)
    assert cost.steps == 0
    cost.observe(MixedStep(8, (row,), (), drafts=((1, 2, 3),)), 0.05)
    cost.observe(_decode(1), 0.04)
    cost.observe(_decode(0), 0.04)  # nothing live: nothing to learn
    assert cost.steps == 2
    with pytest.raises(ValueError, match="decay"):
        DraftCost(decay=1.0)


def _speculating(rid: str) -> Sequence:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    return Sequence(rid, len(prompt), 20, ngrams=NgramIndex(prompt))


@pytest.mark.parametrize(("cost", "drafted"), [(0.010, False), (0.0001, True)])
def test_the_scheduler_drafts_only_where_drafts_pay(cost: float, drafted: bool) -> None:
    """Four decoding rows with drafts to offer: a verify step where a token costs little beside the step, a plain
    decode step where each costs its own arithmetic; the verify results feed the acceptance."""
    s = Scheduler(TABLE, speculative_tokens=3, draft_cost=_fed(0.040, cost, 1, 3))
    rows = [_speculating(r) for r in "abcd"]
    for seq in rows:
        s.add(seq)
    while any(not seq.is_decoding or not seq.num_generated for seq in rows):
        step = s.schedule()
        assert step is not None
        s.update(step, {seq.request_id: 3 for seq in step.sampling_seqs})
    step = s.schedule()
    assert isinstance(step, MixedStep if drafted else DecodeStep)
    if isinstance(step, MixedStep):
        before = s.draft_cost.acceptance
        s.update(step, {seq.request_id: [d[0], 9] for seq, d in zip(step.decode, step.drafts)})  # one of 3 accepted
        assert s.draft_cost.acceptance != before
    s.observe(step, 0.1)
    assert s.draft_cost.steps == 31


def test_drafts_beside_a_prompt_ask_at_the_steps_size() -> None:
    """In a mixed step the drafts' room is only used where drafts pay at the step's size without them (the row
    and the prompt's tokens): a 28-token prompt's step is too big for fp32 drafts, a 2-token one is not."""
    for prompt, drafts in ((28, ()), (2, ((1, 2, 3),))):
        s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0, draft_cost=_fed(0.040, 0.0035, 1, 3))
        a = _speculating("a")
        s.add(a)
        s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]
        s.add(Sequence("p", prompt, 4))
        step = s.schedule()
        assert isinstance(step, MixedStep) and step.drafts == drafts and step.pieces[0].num_tokens == prompt
