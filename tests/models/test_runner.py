"""The bucketed, padded, compiled path against transformers' own eager generate (dynamic cache, no padding)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from buckets import BucketTable, GraphKey
from models.compile import CompileAccountant, CompileSettings, RecompileError
from models.generator import generate_one
from models.loading import load_model
from models.runner import ModelRunner, PrefillRow, UnknownShapeError
from models.sampling import SamplingParams

# KV buckets 16 and 24 sit inside the generated spans of the boundary tests: decode crosses them.
TABLE = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1, 2), context_length=48,
                    kv_lengths=(16, 24, 48))
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def reference(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=1, eos_token_id=None)
    return out[0, len(ids):].tolist()


def warmed(path: str, table: BucketTable) -> Iterator[tuple[ModelRunner, torch.nn.Module]]:
    """A runner over the tiny model with every graph of `table` warmed (dynamo-eager); stopped afterwards."""
    model = load_model(path, "float32", "cpu")
    runner = ModelRunner(model, table, CompileSettings(backend="dynamo-eager"))
    runner.warmup()
    yield runner, model
    runner.stop_serving()


@pytest.fixture(scope="module")
def compiled(tiny_llama: str) -> Iterator[tuple[ModelRunner, torch.nn.Module]]:
    yield from warmed(tiny_llama, TABLE)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16])
def test_greedy_matches_generate_at_bucket_boundaries(compiled, n: int) -> None:
    runner, model = compiled
    ids = random.Random(n).choices(range(5, 400), k=n)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = generate_one(runner, ids, params, TABLE.length_for(n)).token_ids
    assert got == reference(model, ids, 12)


def test_mixed_length_batch_prefill_and_decode(compiled) -> None:
    runner, model = compiled
    prompts = [random.Random(1).choices(range(5, 400), k=5), random.Random(2).choices(range(5, 400), k=8)]
    logits = runner.prefill([PrefillRow(1, prompts[0]), PrefillRow(0, prompts[1])], 8, 2)
    outs = [[int(logits[0].argmax())], [int(logits[1].argmax())]]
    slots, lengths = [1, 0], [5, 8]
    for step in range(9):
        tokens = torch.zeros(2, dtype=torch.long)
        pos = torch.zeros(2, dtype=torch.long)
        for i, slot in enumerate(slots):
            tokens[slot], pos[slot] = outs[i][-1], lengths[i] + step
        step_logits = runner.decode(2, tokens, pos)
        for i, slot in enumerate(slots):
            outs[i].append(int(step_logits[slot].argmax()))
    for ids, out in zip(prompts, outs):
        assert out == reference(model, ids, 10)


def test_decode_logits_do_not_depend_on_the_kv_bucket(compiled) -> None:
    """A row attends over the same positions in every KV bucket that covers it: the result is the same."""
    runner, _ = compiled
    ids = random.Random(3).choices(range(5, 400), k=12)
    runner.prefill([PrefillRow(0, ids)], 16, 1)
    tokens = torch.tensor([7, 0])
    pos = torch.tensor([12, 0])
    outs = [runner.decode(2, tokens, pos, kv).clone() for kv in (16, 24, 48)]
    for other in outs[1:]:
        torch.testing.assert_close(other[0], outs[0][0], rtol=1e-5, atol=1e-5)


def test_a_free_row_is_a_zero_row_and_leaves_the_others_bits(compiled) -> None:
    """A free slot of a decode batch comes at position -1: the graph zeroes its hidden state, which stays zero
    through a model without biases (its logits are zeros: no kernel skipped it to garbage), and the busy row's
    logits are the bits it gets beside an old-style dummy row (token 0 at position 0)."""
    runner, _ = compiled
    ids = random.Random(4).choices(range(5, 400), k=6)
    runner.prefill([PrefillRow(0, ids)], 8, 1)
    beside_dummy = runner.decode(2, torch.tensor([9, 0]), torch.tensor([6, 0])).clone()
    runner.prefill([PrefillRow(0, ids)], 8, 1)
    beside_free = runner.decode(2, torch.tensor([9, 0]), torch.tensor([6, -1])).clone()
    assert torch.equal(beside_free[1], torch.zeros_like(beside_free[1]))
    assert not torch.equal(beside_dummy[1], torch.zeros_like(beside_dummy[1]))
    assert torch.equal(beside_free[0], beside_dummy[0])
    assert runner.accountant.count("serving") == 0


def test_only_models_that_embed_their_ids_and_nothing_else_zero_free_rows() -> None:
    """Zeroing goes through inputs_embeds: a family whose forward does more with input_ids (Gemma3n's per-layer
    inputs, Falcon-H1's embedding multiplier) keeps input_ids and computes its free rows."""
    from types import SimpleNamespace

    from models.step_functions import zeroes_free_rows

    assert zeroes_free_rows(SimpleNamespace(model_type="llama"))
    assert zeroes_free_rows(SimpleNamespace(model_type="qwen2"))
    assert not zeroes_free_rows(SimpleNamespace(model_type="gemma3n_text"))
    assert not zeroes_free_rows(SimpleNamespace(model_type="falcon_h1"))
    assert not zeroes_free_rows(SimpleNamespace())


CHUNKED = BucketTable(lengths=(4, 8), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=48,
                      kv_lengths=(16, 24, 48), chunked_prefill=True)


@pytest.fixture(scope="module")
def chunked(tiny_llama: str) -> Iterator[tuple[ModelRunner, torch.nn.Module]]:
    yield from warmed(tiny_llama, CHUNKED)


@pytest.mark.parametrize("n", [7, 8, 9, 16, 17, 30])  # c - 1, c, c + 1, 2c, 2c + 1, several chunks
def test_chunked_prefill_matches_generate_at_chunk_boundaries(chunked, n: int) -> None:
    runner, model = chunked
    ids = random.Random(100 + n).choices(range(5, 400), k=n)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = generate_one(runner, ids, params, CHUNKED.length_for(n))
    assert got.token_ids == reference(model, ids, 10)
    assert runner.accountant.count("serving") == 0


def test_chunk_logits_equal_the_unchunked_prefill(chunked, compiled) -> None:
    """The same 16-token prompt: one prefill call (unchunked table) vs prefill + one chunk."""
    ids = random.Random(5).choices(range(5, 400), k=16)
    runner, _ = chunked
    runner.prefill([PrefillRow(1, ids[:8])], 8, 1)
    chunk_logits = runner.chunk(1, 8, ids[8:], 16)
    whole = compiled[0].prefill([PrefillRow(0, ids)], 16, 1)
    torch.testing.assert_close(chunk_logits[0], whole[0], rtol=1e-4, atol=1e-4)


def test_no_compilation_after_warmup_for_random_requests(compiled) -> None:
    runner, _ = compiled
    warm = runner.accountant.count()
    assert runner.accountant.count("warmup") == warm == TABLE.num_graphs
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, TABLE.max_length)
        ids = rng.choices(range(5, 400), k=n)
        generate_one(runner, ids, SamplingParams(max_tokens=rng.randint(1, 3), temperature=0),
                     TABLE.length_for(n))
    assert runner.accountant.count() == warm
    assert runner.accountant.count("serving") == 0


def test_logits_with_padded_rows_sample_as_contiguous_ones(compiled) -> None:
    # Inductor on CUDA pads the rows of bf16 logits (stride 424 for a vocabulary of 420): the sampling graph,
    # warmed on contiguous rows, must take them without a recompile and sample what the values say.
    runner, _ = compiled
    vocab = runner.vocab_size
    padded = torch.randn(2, vocab + 4, generator=torch.Generator().manual_seed(3))[:, :vocab]
    assert padded.stride(0) == vocab + 4
    rows = [(0.8, 0, 1.0, 0.0, 7, 3), None]
    want = [t.clone() for t in runner.sample(padded.contiguous(), rows)]
    got = runner.sample(padded, rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    one = torch.randn(1, vocab + 4)[:, :vocab]  # counts as contiguous (one row), yet its stride is vocab + 4
    assert one.is_contiguous() and one.stride(0) == vocab + 4
    assert torch.equal(runner.sample(one, [None])[0], runner.sample(one.clone(), [None])[0])
    assert runner.accountant.count("serving") == 0


def test_shape_outside_table_is_refused_not_compiled(compiled) -> None:
    runner, _ = compiled
    before = runner.accountant.count()
    with pytest.raises(UnknownShapeError):
        runner.prefill([PrefillRow(0, [5, 6])], 12, 1)
    with pytest.raises(UnknownShapeError):
        runner.decode(3, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    assert runner.accountant.count() == before


def test_unwarmed_shape_fails_closed_or_counts_when_allowed(tiny_llama: str) -> None:
    model = load_model(tiny_llama, "float32", "cpu")
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=16)
    only_decode = [GraphKey("decode", 1, 16)]
    strict = ModelRunner(model, table, CompileSettings(backend="dynamo-eager", recompile_policy="error"))
    strict.warmup(only_decode)
    with pytest.raises(RecompileError):
        strict.prefill([PrefillRow(0, [5])], 8, 1)
    allowed = ModelRunner(model, table, CompileSettings(backend="dynamo-eager", recompile_policy="allow"),
                          CompileAccountant())
    allowed.warmup(only_decode)
    allowed.prefill([PrefillRow(0, [5])], 8, 1)
    serving = [r for r in allowed.accountant.records if r.phase == "serving"]
    assert [r.key for r in serving] == [GraphKey("prefill", 1, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("freezing", [False, True])
def test_inductor_greedy_matches_generate(tiny_llama: str, freezing: bool) -> None:
    """The real compiled path (inductor, C++ codegen): slow, so only in `make test-slow`."""
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=24,
                        kv_lengths=(12, 24))  # generation crosses the KV boundary at 12
    model = load_model(tiny_llama, "float32", "cpu")
    runner = ModelRunner(model, table, CompileSettings(backend="inductor", inductor_freezing=freezing))
    runner.warmup()
    for n in (1, 7, 8):
        ids = random.Random(n).choices(range(5, 400), k=n)
        got = generate_one(runner, ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), 8)
        assert got.token_ids == reference(model, ids, 12)
    assert runner.accountant.count("warmup") == table.num_graphs and runner.accountant.count("serving") == 0


@pytest.mark.parametrize(("flag", "compiled"), [("--no-mixed-steps", 5), ("--mixed-steps", 3)])
def test_generate_command_chunks_a_long_prompt(tiny_llama: str, capsys, flag: str, compiled: int) -> None:
    from server.cli import main

    argv = ["generate", "--model", tiny_llama, "--prompt", "the cat sat on the mat " * 8, "--max-tokens", "4",
            "--compile-backend", "dynamo-eager", "--dtype", "float32", "--buckets", "8,16", "--prefill-chunk-size", "16",
            "--max-model-len", "128", "--kv-buckets", "32,64", "--compile-cache-dir", "none", "--num-threads", "1",
            "--batch-sizes", "1,2", flag]
    assert main(argv) == 0
    err = capsys.readouterr().err
    # 48 prompt tokens: request bucket 48; decode graphs up to KV 64, then either one prefill and chunk graphs at KV
    # 32 and 64 (three pieces of 16), or one solo mixed step of 64 tokens (mixed buckets 8, 16, 32, 64).
    assert "bucket 48 (prompt 48 tokens" in err and f"{compiled} compiled, 0 after warm-up" in err
