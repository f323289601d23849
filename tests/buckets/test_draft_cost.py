"""Cost-aware drafts without a model: the step-time line fitted from observed steps, the threshold it sets, and the
scheduler leaving out the drafts of rows whose acceptance does not reach it (and keeping those of rows that do)."""

from __future__ import annotations

import pytest

from buckets import BucketTable
from buckets.draft_cost import DraftCost
from buckets.scheduler import DecodeStep, MixedStep, Piece, Scheduler, Sequence
from buckets.speculation import NgramIndex

TABLE = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                    mixed_tokens=(8, 16, 32, 64), draft_rows=8)


def _decode(rows: int) -> DecodeStep:
    seqs = tuple(Sequence(f"r{i}", 4, 8, slot=i, position=4) for i in range(rows))
    return DecodeStep(TABLE.batch_for(max(rows, 1)), TABLE.context_length, seqs)


def _fed(a: float, b: float, sizes: tuple[int, ...] = (1, 2, 4)) -> DraftCost:
    """A DraftCost that saw decode steps of `sizes` rows take a + b * rows seconds."""
    cost = DraftCost()
    for _ in range(10):
        for rows in sizes:
            cost.observe(_decode(rows), a + b * rows)
    return cost


def test_the_line_is_fitted_from_the_steps_seen() -> None:
    assert _fed(0.040, 0.0035).fit() == pytest.approx((0.040, 0.0035, 0.0035))  # no drafts seen: c = b


def test_one_size_alone_gives_no_line_and_every_draft_runs_until_measured() -> None:
    cost = DraftCost()
    assert cost.fit() is None and cost.threshold(64) == 0.0  # nothing seen
    for _ in range(20):
        cost.observe(_decode(4), 0.08)
    assert cost.fit() is None and cost.threshold(64) == 0.0  # no slope from steps of one size


def test_the_threshold_is_a_tokens_share_of_the_step() -> None:
    """q > b n / (a + b n): fp32 on 256-bit FMAs (~40 ms a step, ~3.5 ms a token) asks little of a draft beside one
    row and more than half beside 16; a memory-bound bf16 step (~0.6 ms a token of ~35) a fifth at 16 rows."""
    fp32 = _fed(0.040, 0.0035)
    assert fp32.threshold(1) == pytest.approx(0.0035 / 0.0435)
    assert fp32.threshold(16) == pytest.approx(0.056 / 0.096)
    assert fp32.threshold(4) < fp32.threshold(8) < fp32.threshold(16) < 1.0
    assert _fed(0.035, 0.0006).threshold(16) == pytest.approx(0.0096 / 0.0446)
    assert _fed(0.040, 0.0).threshold(1000) == pytest.approx(0.0, abs=1e-9)  # a token costs nothing: all pay


def _verify(rows: int, drafts: int) -> MixedStep:
    """A verify step of `rows` decoding rows carrying `drafts` drafts in all (the first row carries them)."""
    seqs = tuple(Sequence(f"r{i}", 4, 8, slot=i, position=4) for i in range(rows))
    return MixedStep(64, seqs, (), drafts=(tuple(range(drafts)),) + ((),) * (rows - 1))


def test_drafts_are_priced_apart_from_rows_once_they_vary_apart() -> None:
    """A draft's run reads its row's K/V already, so it costs less than a row: verify steps of varying drafts beside
    decode steps give the draft its own price, and the threshold asks less of a draft for it."""
    cost = _fed(0.030, 0.005)
    assert cost.fit() == pytest.approx((0.030, 0.005, 0.005))  # no drafts seen: a draft is priced as a row
    rows_only = cost.threshold(16)
    for _ in range(10):
        for rows, drafts in ((2, 4), (2, 12), (4, 8), (1, 20)):
            cost.observe(_verify(rows, drafts), 0.030 + 0.005 * rows + 0.003 * drafts)
    assert cost.fit() == pytest.approx((0.030, 0.005, 0.003))
    assert cost.threshold(16) == pytest.approx(0.003 * 16 / (0.030 + 0.005 * 16)) and cost.threshold(16) < rows_only


def test_recent_steps_weigh_more() -> None:
    """The line follows the machine: after a slower spell the fit moves to it."""
    cost = _fed(0.040, 0.001)
    for _ in range(300):
        for rows in (1, 2, 4):
            cost.observe(_decode(rows), 0.040 + 0.004 * rows)
    fit = cost.fit()
    assert fit is not None and fit[1] == pytest.approx(0.004, rel=1e-3)


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
    """A row whose prompt repeats "1 2 3": its drafts continue the loop."""
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    return Sequence(rid, len(prompt), 20, ngrams=NgramIndex(prompt))


def _next(seq: Sequence) -> int:
    """The loop's next token after `seq`'s tokens so far."""
    assert seq.ngrams is not None
    return (1, 2, 3)[len(seq.ngrams.tokens) % 3]


def _decoding(s: Scheduler, rows: list[Sequence], hits: float = 1.0, misses: float = 1.0) -> None:
    """Prefill `rows`, give each its first token, then set each one's acceptance to hits / (hits + misses)."""
    for seq in rows:
        s.add(seq)
    while any(not seq.is_decoding or not seq.num_generated for seq in rows):
        step = s.schedule()
        assert step is not None
        s.update(step, {seq.request_id: _next(seq) for seq in step.sampling_seqs})
    for seq in rows:
        assert seq.ngrams is not None
        seq.ngrams.hits, seq.ngrams.misses = hits, misses


@pytest.mark.parametrize(("cost", "hits", "drafts"), [
    (0.012, 1.0, 0),  # fp32-like: a token costs a fifth of the 4-row step (threshold 0.55), half the drafts accepted
    (0.012, 40.0, 3),  # rows that loop (acceptance 0.98): all their drafts pay
    (0.0001, 1.0, 3),  # a token costs nothing beside the step (threshold 0.01): every draft pays
])
def test_the_scheduler_drafts_only_where_a_rows_drafts_pay(cost: float, hits: float, drafts: int) -> None:
    """Four decoding rows with drafts to offer: a verify step where their chance pays for what a token costs beside
    the step, a plain decode step where it does not."""
    table = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128,
                        mixed_tokens=(8, 16, 32, 64), draft_rows=12)  # room for every row's 3
    s = Scheduler(table, speculative_tokens=3, draft_cost=_fed(0.040, cost))
    rows = [_speculating(r) for r in "abcd"]
    _decoding(s, rows, hits=hits)
    step = s.schedule()
    assert isinstance(step, MixedStep if drafts else DecodeStep)
    if isinstance(step, MixedStep):
        assert [len(d) for d in step.drafts] == [drafts] * 4
    s.observe(step, 0.1)
    assert s.draft_cost.steps == 31


def test_a_row_without_drafts_learns_what_they_would_have_yielded() -> None:
    """A decode step's token is checked against the draft each row would have carried: a row whose loop the steps
    confirm gains acceptance until its drafts pay at the step's size, one that leaves its loop loses it; a verify
    step's rejection counts too."""
    s = Scheduler(TABLE, speculative_tokens=3, draft_cost=_fed(0.040, 0.030))  # 2 rows: threshold 0.6
    a, b = _speculating("a"), _speculating("b")
    _decoding(s, [a, b])
    assert a.ngrams is not None and b.ngrams is not None
    for steps in range(1, 10):
        step = s.schedule()
        assert step is not None
        if isinstance(step, MixedStep):
            break
        # a continues the loop (its would-be draft held), b does not
        s.update(step, {"a": _next(a), "b": 99 + steps})
    assert isinstance(step, MixedStep) and 1 < steps
    assert b.ngrams.acceptance < 0.5 < a.ngrams.acceptance
    assert step.decode == (a, b) and step.drafts[0] and not step.drafts[1]
    before = a.ngrams.acceptance
    s.update(step, {"a": [77], "b": 5})  # a's first draft rejected
    assert a.ngrams.acceptance < before


def test_drafts_beside_a_prompt_ask_at_the_steps_size() -> None:
    """In a mixed step the drafts' room is only used where drafts pay at the step's size without them (the row
    and the prompt's tokens): a 28-token prompt's step is too big for fp32 drafts at even odds, a 2-token one takes
    the two whose chance (1/2, 1/4) is above its threshold (0.21)."""
    for prompt, drafts in ((28, ()), (2, ((1, 2),))):
        s = Scheduler(TABLE, speculative_tokens=3, waiting_served_ratio=0, draft_cost=_fed(0.040, 0.0035))
        a = _speculating("a")
        s.add(a)
        s.update(s.schedule(), {"a": 3})  # type: ignore[arg-type]
        s.add(Sequence("p", prompt, 4))
        step = s.schedule()
        assert isinstance(step, MixedStep) and step.drafts == drafts and step.pieces[0].num_tokens == prompt
