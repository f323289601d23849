"""`bucketserve verify` on tiny models: passes on the real path, names the bucket of a planted defect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buckets import BucketTable
from server.cli import main
from server.commands.verify_cases import plan_cases

TABLE = ["--buckets", "8,16", "--prefill-chunk-size", "16", "--max-model-len", "64", "--kv-buckets", "24,32",
         "--batch-sizes", "1,2,4", "--prefill-batch-sizes", "1,2"]


def verify(model: str, out: Path, *extra: str) -> tuple[int, dict]:
    argv = ["verify", "--model", model, "--compile-backend", "dynamo-eager", "--dtype", "float32",
            "--num-threads", "1", "--compile-cache-dir", "none", "--max-tokens", "10", "--out", str(out),
            *TABLE, *extra]
    code = main(argv)
    return code, json.loads((out / "report.json").read_text())


def test_cases_stay_within_the_largest_bucket_without_chunked_prefill() -> None:
    # A 128-token context over buckets up to 64 and no chunking admits prompts of at most 64 tokens: a "b+1"
    # case of 65 was refused by the scheduler and ended the whole run with a traceback.
    table = BucketTable(lengths=(8, 16, 32, 64), context_length=128, kv_lengths=(32, 128))
    lengths = {c.prompt_len for c in plan_cases(table, list(range(100, 400)), max_tokens=10)}
    assert max(lengths) == 64 and {63, 9, 33} <= lengths


def test_kv_crossings_beyond_the_longest_prompt_come_from_long_generations() -> None:
    # Without chunked prefill prompts stop at 64 tokens, below KV 128 and 256: a crossing case cannot come from
    # the prompt, so the longest prompt generates until it has crossed (before: the cases were dropped, unlisted).
    table = BucketTable(lengths=(8, 16, 32, 64), context_length=512, kv_lengths=(32, 128, 256, 512))
    cases = plan_cases(table, list(range(100, 400)), max_tokens=10)
    long = {c.name: (c.prompt_len, c.max_tokens) for c in cases if c.max_tokens != 10}
    assert long == {"decode crosses KV 128 (long generation)": (64, 69),
                    "decode crosses KV 256 (long generation)": (64, 197)}
    assert any(c.name == "decode crosses KV 32" and c.prompt_len == 27 for c in cases)
    assert all(c.prompt_len + c.max_tokens <= 512 and c.scored == min(c.max_tokens, 10) for c in cases)
    for max_tokens in (3, 4, 10):  # decode steps write positions prompt .. prompt + tokens - 2: one spans each kv
        planned = plan_cases(table, list(range(100, 400)), max_tokens)
        assert all(any(c.prompt_len < kv <= c.prompt_len + c.max_tokens - 2 for c in planned) for kv in (32, 128, 256))


def test_a_long_generation_counts_toward_agreement_as_much_as_any_case() -> None:
    from server.commands.verify import Outcome, compare

    table = BucketTable(lengths=(8, 16, 32, 64), context_length=512, kv_lengths=(32, 128, 256, 512))
    long = next(c for c in plan_cases(table, list(range(100, 400)), max_tokens=10) if "long" in c.name)
    ref = Outcome(list(range(long.max_tokens)))
    ours = Outcome(list(range(20)) + [-1] * (long.max_tokens - 20))  # diverges at token 20 of 69
    report = compare(table, [long], [ours], [ref])[0]
    assert (report.matched, report.total, report.first_divergence) == (10, 10, 20)


def test_cases_cover_buckets_chunks_kv_crossings_and_waves() -> None:
    table = BucketTable(lengths=(8, 16), context_length=64, kv_lengths=(24, 32, 64), chunked_prefill=True)
    cases = plan_cases(table, list(range(100, 400)), max_tokens=10)
    lengths = {c.prompt_len for c in cases}
    assert {1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49} <= lengths  # b-1, b, b+1; c*m-1, c*m, c*m+1
    assert {24 - 5, 32 - 5} <= lengths  # generation crosses KV 24 and KV 32
    assert max(lengths) <= 64 - 10 and {c.wave for c in cases} == {0, 1} and {c.logprobs for c in cases} == {True, False}
    assert len({c.ids[:3] for c in cases if c.prompt_len >= 3}) == len([c for c in cases if c.prompt_len >= 3])


def test_verify_passes_on_the_serving_path(tiny_llama: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"the cat sat on mat number {i}"}) for i in range(40)) + "\n")
    code, report = verify(tiny_llama, tmp_path, "--prompts-file", str(prompts))
    assert code == 0 and report["verdict"] == "pass" and report["agreement"] == 1.0
    graphs = report["graphs"]
    # long prompts continue in mixed steps (the CPU default), riding with the decoding rows of other cases
    assert any(k.startswith("decode[b4") for k in graphs) and any(k.startswith("mixed[") for k in graphs)
    assert any(k.startswith("sample[") for k in graphs)  # logprob cases take the sampling graph
    assert all(c["max_logprob_diff"] is None or c["max_logprob_diff"] < 1e-4 for c in report["cases"])


def test_verify_catches_an_off_by_one_decode_mask(tiny_llama: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import models.step_functions

    real = models.step_functions.decode_mask

    def shifted(pos, kv_length, *args):  # the planted defect: each row stops seeing its newest token
        return real(pos - 1, kv_length, *args)

    monkeypatch.setattr(models.step_functions, "decode_mask", shifted)
    # Speculative decoding off: with it, verify steps (mixed graphs, no decode mask) carry nearly every greedy row.
    code, report = verify(tiny_llama, tmp_path, "--num-speculative-tokens", "0")
    assert code == 1 and report["verdict"] == "FAIL"
    failing = {c["bucket"] for c in report["cases"] if c["first_divergence"] is not None}
    assert failing and all(str(b) in report["per_bucket"] for b in failing)
    assert "| case | bucket |" in (tmp_path / "report.md").read_text()


def test_verify_against_a_running_server(tiny_llama: str, tmp_path: Path) -> None:
    from server.config import ServerSettings
    from tests.support.served import serve
    from tests.support.tiny import tiny_settings

    settings = tiny_settings(model=tiny_llama, compile_backend="dynamo-eager", buckets=(8, 16), prefill_chunk_size=16,
                             max_model_len=64, kv_buckets=(24, 32), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2))
    assert isinstance(settings, ServerSettings)
    with serve(settings) as served:
        code, report = verify(tiny_llama, tmp_path, "--against", served.server.url)
    assert code == 0 and report["against"] == served.server.url and report["agreement"] == 1.0
    assert all(c["first_divergence"] is None for c in report["cases"])


def test_verify_measures_int8_against_eager_bf16(tiny_llama: str, tmp_path: Path) -> None:
    """--quantize int8 --reference-dtype bfloat16: the agreement of the int8 serving path with plain bf16."""
    from models import native_matmul

    if not native_matmul.amx_available():
        pytest.skip("--quantize int8 needs AMX")
    code, report = verify(tiny_llama, tmp_path, "--dtype", "bfloat16", "--quantize", "int8", "--reference-dtype",
                          "bfloat16", "--min-agreement", "0.5")
    assert report["quantize"] == "int8" and report["reference_dtype"] == "bfloat16" and report["dtype"] == "bfloat16"
    assert code == 0 and report["verdict"] == "pass" and "token agreement >= 0.5" in report["rule"]
    assert "int8 weights" in (tmp_path / "report.md").read_text() and "against eager bfloat16" in (
        tmp_path / "report.md").read_text()
