"""Mixed steps: decoding rows and prompt pieces of several slots on one token axis give the tokens and logits
that separate prefill, chunk and decode steps give (and transformers' eager generate)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from buckets import BucketTable, GraphKey
from models.compile import CompileSettings
from models.generator import generate_one
from models.loading import load_model
from models.mixed_attention import mixed_plan
from models.runner import ModelRunner, PrefillRow
from models.sampling import SamplingParams
from tests.models.test_runner import reference, warmed

# Mixed token buckets 8 and 16 with 4 slots: a step of 4 decoding rows leaves 12 tokens for prompts.
MIXED = BucketTable(lengths=(4, 8), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=48,
                    kv_lengths=(48,), chunked_prefill=True, mixed_tokens=(8, 16))


@pytest.fixture(scope="module")
def mixed(tiny_llama: str) -> Iterator[tuple[ModelRunner, torch.nn.Module]]:
    yield from warmed(tiny_llama, MIXED)


def _prompt(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(5, 400), k=n)


def test_mixed_plan_groups_pieces_and_decoding_rows() -> None:
    # slots 0, 1 decode (positions 9, 3), slot 3 decodes (position 5), slot 2 a piece at 4..12, two pads (slot 9)
    meta = torch.tensor([[0, 9], [1, 3], [3, 5]] + [[2, p] for p in range(4, 13)] + [[9, 0], [9, 0]])
    plan = mixed_plan(meta.numpy().tobytes(), 9)
    assert plan == ((0, 3, (0, 1, 3), (10, 4, 6), True), (3, 12, (2,), (4,), False))
    # a short run (a verify step's row: its last token at 4, drafts at 5, 6) joins the decoding rows as one row a
    # token, each seeing its slot up to its own position; so does a short prompt piece (slot 0 at 0, 1)
    meta = torch.tensor([[1, 4], [1, 5], [1, 6], [2, 0], [0, 0], [0, 1], [3, 3]])
    assert mixed_plan(meta.numpy().tobytes(), 9) == ((0, 7, (1, 1, 1, 2, 0, 0, 3), (5, 6, 7, 1, 1, 2, 4), True),)
    # where a run kernel takes runs of 2+ tokens (bf16 on AMX tiles), they are pieces: one call each, the single
    # rows between them decoding rows
    assert mixed_plan(meta.numpy().tobytes(), 9, 2) == (
        (0, 3, (1,), (4,), False), (3, 4, (2,), (1,), True), (4, 6, (0,), (0,), False), (6, 7, (3,), (4,), True))
    # runs of 3+ (run_vec.c): the 2-token run of slot 0 goes as two decoding rows, beside its neighbours
    assert mixed_plan(meta.numpy().tobytes(), 9, 3) == (
        (0, 3, (1,), (4,), False), (3, 7, (2, 0, 0, 3), (1, 1, 2, 4), True))


def test_greedy_tokens_match_generate_when_every_step_is_mixed(mixed) -> None:
    """Three prompts enter while others decode, one of them cut across two steps; each continues to 10 tokens."""
    runner, model = mixed
    prompts = {0: _prompt(1, 5), 1: _prompt(2, 11), 2: _prompt(3, 3)}
    out: dict[int, list[int]] = {s: [] for s in prompts}
    # step 1: slot 0 whole (5 tokens) + slot 1's first 3 tokens -> bucket 8
    logits = runner.mixed(8, prompts[0] + prompts[1][:3], list(range(5)) + list(range(3)), [0] * 5 + [1] * 3, [4])
    out[0].append(int(logits[0].argmax()))
    # step 2: slot 0 decodes, slot 1's other 8 tokens, slot 2 whole -> 12 tokens, bucket 16
    ids = [out[0][-1]] + prompts[1][3:] + prompts[2]
    pos = [5] + list(range(3, 11)) + list(range(3))
    logits = runner.mixed(16, ids, pos, [0] + [1] * 8 + [2] * 3, [0, 8, 11])
    for row, slot in enumerate((0, 1, 2)):
        out[slot].append(int(logits[row].argmax()))
    while any(len(t) < 10 for t in out.values()):  # then all three decode in mixed steps (3 tokens, bucket 8)
        live = [s for s in out if len(out[s]) < 10]
        ids = [out[s][-1] for s in live]
        pos = [len(prompts[s]) + len(out[s]) - 1 for s in live]
        logits = runner.mixed(8, ids, pos, live, list(range(len(live))))
        for row, slot in enumerate(live):
            out[slot].append(int(logits[row].argmax()))
    for slot, ids in prompts.items():
        assert out[slot] == reference(model, ids, 10), slot
    assert runner.accountant.count("serving") == 0


def test_mixed_logits_equal_separate_prefill_and_decode(mixed) -> None:
    """Slot 1 decodes while slot 0 takes an 8-token prompt: the same logits as a decode step and a prefill."""
    runner, _ = mixed
    first, second = _prompt(7, 6), _prompt(8, 8)
    runner.prefill([PrefillRow(1, first)], 8, 1)
    decode_alone = runner.decode(2, torch.tensor([0, 42]), torch.tensor([0, 6])).clone()
    prefill_alone = runner.prefill([PrefillRow(0, second)], 8, 1).clone()
    runner.prefill([PrefillRow(1, first)], 8, 1)  # slot 1 back to its prompt only
    both = runner.mixed(16, [42] + second, [6] + list(range(8)), [1] + [0] * 8, [0, 8])
    torch.testing.assert_close(both[0], decode_alone[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], prefill_alone[0], rtol=1e-4, atol=1e-4)


def test_padding_tokens_of_a_mixed_step_are_zero_rows(mixed) -> None:
    """The runner gives a mixed step's padding tokens position -1 and the step zeroes them (so the CPU kernels can
    skip them): the logits at a padding token are zeros, and the real tokens' are what they are without the zeroing
    (the step function run eagerly on the runner's inputs, keeping a padding token's row too)."""
    from models.step_functions import make_mixed_step

    mixed_step = make_mixed_step(True)
    runner, model = mixed
    first = _prompt(9, 6)
    runner.prefill([PrefillRow(1, first)], 8, 1)
    cache = runner._mixed_caches[8]
    ids = torch.tensor([[42, 0, 0, 0, 0, 0, 0, 0]])
    meta = torch.tensor([[1, 6]] + [[runner.storage.spare_slot, 0]] * 7)
    keep = torch.tensor([0, 5, 0, 0])
    with torch.no_grad():
        zeroed = mixed_step(model, cache, ids, torch.tensor([[6] + [-1] * 7]), meta, keep).clone()
        runner.prefill([PrefillRow(1, first)], 8, 1)
        plain = mixed_step(model, cache, ids, torch.tensor([[6] + [0] * 7]), meta, keep).clone()
    assert torch.equal(zeroed[1], torch.zeros_like(zeroed[1]))
    assert not torch.equal(plain[1], torch.zeros_like(plain[1]))
    torch.testing.assert_close(zeroed[0], plain[0], rtol=0, atol=0)
    calls: list[tuple[torch.Tensor, ...]] = []
    real = runner._call

    def recording(key: object, *args: torch.Tensor) -> torch.Tensor:
        calls.append(args)
        return real(key, *args)

    runner._call = recording  # type: ignore[method-assign]
    try:
        runner.mixed(8, [42], [6], [1], [0])  # the runner pads the same way
    finally:
        del runner._call
    _, _, positions, sent_meta, _ = calls[0]
    assert positions.tolist() == [[6] + [-1] * 7]  # padding at -1 for the model
    assert torch.equal(sent_meta, meta)  # and at position 0 of the spare slot for the cache


def test_mixed_step_refuses_what_does_not_fit(mixed) -> None:
    runner, _ = mixed
    with pytest.raises(ValueError):
        runner.mixed(8, list(range(9)), list(range(9)), [0] * 9, [8])
    with pytest.raises(ValueError):
        runner.mixed(8, [1], [0], [4], [0])  # slot 4 is the spare slot, not a row's
    with pytest.raises(ValueError):
        runner.mixed(8, [1], [48], [0], [0])  # past the context


def test_the_inductor_mixed_graph_gives_the_eager_logits(tiny_llama: str, mixed) -> None:
    """The compiled path: inductor's in-place cache writes and the opaque attention op in one graph (bf16,
    prepacked linears: the CPU default) against the same steps run eagerly."""
    eager = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), MIXED, CompileSettings(backend="eager"))
    compiled = ModelRunner(load_model(tiny_llama, "bfloat16", "cpu"), MIXED, CompileSettings(backend="inductor"))
    compiled.warmup([GraphKey("mixed", 4, 8), GraphKey("mixed", 4, 16)])
    first, second, third = _prompt(11, 6), _prompt(12, 7), _prompt(13, 3)
    steps = [  # two prompts enter (13 tokens), then both decode while a third enters (5 tokens)
        (16, first + second, [*range(6), *range(7)], [0] * 6 + [1] * 7, [5, 12]),
        (8, [50, 60] + third, [6, 7, *range(3)], [0, 1, 2, 2, 2], [0, 1, 4]),
    ]
    for tokens, ids, positions, slots, keep in steps:
        want = eager.mixed(tokens, ids, positions, slots, keep)[: len(keep)].float()
        got = compiled.mixed(tokens, ids, positions, slots, keep)[: len(keep)].float()
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert compiled.accountant.count("serving") == 0


def test_generate_one_continues_a_long_prompt_in_mixed_steps(mixed) -> None:
    runner, model = mixed
    ids = _prompt(21, 30)  # a prefill of 8, then mixed steps of 16 and 6 tokens
    calls = runner.calls[GraphKey("mixed", 4, 16)] + runner.calls[GraphKey("mixed", 4, 8)]
    got = generate_one(runner, ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), MIXED.length_for(30))
    assert got.token_ids == reference(model, ids, 8)
    assert runner.calls[GraphKey("mixed", 4, 16)] + runner.calls[GraphKey("mixed", 4, 8)] == calls + 2
