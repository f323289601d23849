from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from buckets import GraphKey
from server.arguments import add_server_arguments, parse_args, settings_from_args
from server.config import ServerSettings, SettingsError


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return settings_from_args(parse_args(parser, argv), environ=env or {})


def test_a_flag_at_its_default_value_still_wins_over_the_environment() -> None:
    env = {"BUCKETSERVE_PORT": "9000", "BUCKETSERVE_DTYPE": "float32", "BUCKETSERVE_MAX_MODEL_LEN": "512"}
    s = parse(["--port", "8000", "--dtype", "auto"], env)
    assert (s.port, s.dtype) == (ServerSettings().port, ServerSettings().dtype) == (8000, "auto")
    assert s.max_model_len == 512  # not given: the environment's


def test_flags_win_over_environment_and_defaults() -> None:
    s = parse(["--max-model-len", "512"], {"BUCKETSERVE_MAX_MODEL_LEN": "1024", "BUCKETSERVE_DTYPE": "bfloat16",
                                          "BUCKETSERVE_BUCKETS": "64,128"})
    assert s.max_model_len == 512 and s.dtype == "bfloat16" and s.buckets == (64, 128)


def test_mixed_steps_are_on_by_default_on_the_cpu_only() -> None:
    assert parse([]).mixed_steps is True and parse(["--no-mixed-steps"]).mixed_steps is False
    assert parse([], {"BUCKETSERVE_MIXED_STEPS": "0"}).mixed_steps is False
    table = parse([]).bucket_table(2048)
    # up to the chunk length with rows decoding, then doublings up to 1024 for steps without (solo steps)
    assert table.mixed_tokens == (32, 64, 128, 256, 512, 1024) and table.chunk_kv_lengths == ()
    # with rows decoding a step carries up to 128 tokens (--max-step-tokens auto), without them up to 1024
    assert (table.max_step_tokens, table.mixed_budget, table.solo_budget) == (128, 128, 1024)
    assert GraphKey("mixed", 16, 256) in set(table.graph_keys())
    for off in (["--no-mixed-steps"], ["--batching", "static"], ["--device", "cuda"]):
        assert parse(off).bucket_table(2048).mixed_tokens == (), off
    # the CPU's length buckets start at 32 (short prompts' prefill), other devices' at 64 (fewer slow compiles)
    assert table.lengths == (32, 64, 128, 256) and parse(["--device", "cuda"]).bucket_table(2048).lengths[0] == 64
    assert parse([]).bucket_table(2048, mixed_ok=False).mixed_tokens == ()  # sliding-window models


def test_native_kernels_are_on_by_default_and_can_be_turned_off() -> None:
    assert parse([]).native_kernels is True and parse(["--no-native-kernels"]).native_kernels is False
    assert parse([], {"BUCKETSERVE_NATIVE_KERNELS": "0"}).native_kernels is False


def test_weight_prepack_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse([]).weight_prepack is True
    assert parse(["--no-weight-prepack"]).weight_prepack is False
    assert parse([], {"BUCKETSERVE_WEIGHT_PREPACK": "0"}).weight_prepack is False


def test_quantize_is_off_by_default_and_int8_needs_the_cpu_bf16_path() -> None:
    assert parse([]).quantize == "none"
    assert parse(["--quantize", "int8"]).quantize == "int8"
    assert parse([], {"BUCKETSERVE_QUANTIZE": "int8"}).quantize == "int8"
    for argv in (["--dtype", "float32"], ["--no-weight-prepack"], ["--no-native-kernels"], ["--inductor-freezing"],
                 ["--tensor-parallel-size", "2"], ["--device", "cuda"]):
        with pytest.raises(SettingsError, match="--quantize int8 needs"):
            parse(["--quantize", "int8", *argv]).check_quantize()
    parse(["--quantize", "int8", "--dtype", "bfloat16"]).check_quantize()  # the CPU bf16 path: fine
    with pytest.raises(SettingsError, match="quantize"):
        ServerSettings(quantize="int4")


@pytest.mark.parametrize("argv, env, message", [
    (["--api-key", ""], {}, "must not be empty"),
    ([], {"BUCKETSERVE_API_KEY": ""}, "must not be empty"),
    (["--port", "0"], {}, "port"),
    ([], {"BUCKETSERVE_MAX_MODEL_LEN": "many"}, "BUCKETSERVE_MAX_MODEL_LEN"),
    (["--compile-backend", "neuron"], {}, "needs device 'neuron'"),
    (["--waiting-served-ratio", "-1"], {}, "waiting_served_ratio"),
    ([], {"BUCKETSERVE_WAITING_SERVED_RATIO": "nan"}, "waiting_served_ratio"),
    (["--waiting-served-ratio", "inf"], {}, "waiting_served_ratio"),
    (["--drain-timeout", "nan"], {}, "drain_timeout"),  # a NaN drain ended every stream at once
    (["--request-timeout", "inf"], {}, "request_timeout"),
])
def test_bad_settings_are_refused_with_the_setting_named(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        parse(argv, env)


def test_waiting_served_ratio_is_one_by_default_and_settable() -> None:
    assert parse([]).waiting_served_ratio == 1
    assert parse(["--waiting-served-ratio", "0"]).waiting_served_ratio == 0
    assert parse(["--waiting-served-ratio", "1.2"]).waiting_served_ratio == 1.2
    assert parse([], {"BUCKETSERVE_WAITING_SERVED_RATIO": "0.5"}).waiting_served_ratio == 0.5


def test_bucket_table_never_exceeds_the_model_or_max_model_len() -> None:
    assert ServerSettings(max_model_len=4096).bucket_table(1024).context_length == 1024
    assert ServerSettings(buckets=(64, 256), max_model_len=512).bucket_table(8192).context_length == 512
    with pytest.raises(SettingsError, match="larger|smaller|exceeds"):
        ServerSettings(buckets=(64, 4096), max_model_len=512).bucket_table(8192)


def test_kv_buckets_flag_env_and_context_closing() -> None:
    assert ServerSettings(device="neuron").bucket_table(8192).kv_lengths == (256, 512, 1024, 2048)
    assert ServerSettings().bucket_table(8192).kv_lengths == (2048,)  # the CPU's attention op trims per row
    assert parse(["--kv-buckets", "128,512"], {}).bucket_table(8192).kv_lengths == (128, 512, 2048)
    assert parse([], {"BUCKETSERVE_KV_BUCKETS": "512"}).bucket_table(1024).kv_lengths == (512, 1024)
    with pytest.raises(SettingsError, match="kv_lengths"):
        ServerSettings(kv_buckets=(256, 4096)).bucket_table(8192)


def test_a_buckets_file_can_be_chunked(tmp_path) -> None:
    from buckets import BucketTable

    path = tmp_path / "t.json"
    BucketTable((64, 256), context_length=1024).save(path)
    table = ServerSettings(buckets_file=str(path), prefill_chunk_size=256).bucket_table(4096)
    assert table.chunked_prefill and table.chunk_length == 256
    assert not ServerSettings(buckets_file=str(path)).bucket_table(4096).chunked_prefill
    with pytest.raises(SettingsError, match="largest bucket 256"):
        ServerSettings(buckets_file=str(path), prefill_chunk_size=128).bucket_table(4096)


def test_mixed_tokens_of_a_buckets_file_apply_only_where_mixed_steps_run(tmp_path) -> None:
    from buckets import BucketTable

    path = tmp_path / "buckets.json"
    # a served table saved as it was (precompile's manifest, verify's report): with speculative decoding's rows
    BucketTable(lengths=(64, 128), batch_sizes=(1, 4), context_length=512, mixed_tokens=(64, 128),
                draft_rows=12).save(path)
    table = ServerSettings(buckets_file=str(path)).bucket_table(4096)
    assert table.mixed_tokens == (64, 128) and table.draft_rows == 12  # the settings' 3 a slot
    assert ServerSettings(buckets_file=str(path), num_speculative_tokens=0).bucket_table(4096).draft_rows == 0
    for off in (dict(mixed_steps=False), dict(batching="static"), dict(device="cuda"), dict(tensor_parallel_size=2)):
        table = ServerSettings(buckets_file=str(path), **off).bucket_table(4096)  # type: ignore[arg-type]
        assert table.mixed_tokens == () and table.draft_rows == 0, off


def test_mixed_budget_is_capped_without_chunking() -> None:
    # no chunked prefill: length buckets up to 2048, mixed steps up to 256 tokens (they cut any prompt)
    unchunked = parse(["--prefill-chunk-size", "0", "--max-step-tokens", "0"]).bucket_table(2048)
    assert unchunked.mixed_tokens == (32, 64, 128, 256, 512, 1024) and unchunked.mixed_budget == 256
    chunk512 = parse(["--prefill-chunk-size", "512", "--max-step-tokens", "0"]).bucket_table(2048)
    assert chunk512.mixed_tokens == (32, 64, 128, 256, 512, 1024) and chunk512.mixed_budget == 512
    small = parse(["--max-model-len", "512", "--max-step-tokens", "0"]).bucket_table(512)  # solo stops at the context
    assert small.mixed_tokens == (32, 64, 128, 256, 512) and (small.mixed_budget, small.solo_budget) == (256, 512)


def test_max_step_tokens_auto_is_128_where_the_table_allows(tmp_path) -> None:
    assert parse(["--prefill-chunk-size", "512"]).bucket_table(2048).mixed_budget == 128
    assert parse(["--max-step-tokens", "64"]).bucket_table(2048).mixed_budget == 64
    assert parse(["--max-step-tokens", "512"]).bucket_table(2048).mixed_budget == 512  # any token bucket
    assert parse([], {"BUCKETSERVE_MAX_STEP_TOKENS": "0"}).bucket_table(2048).mixed_budget == 256
    # the chunk is already below 128, or the batch leaves a 128-token step no room: up to the chunk
    assert parse(["--prefill-chunk-size", "64"]).bucket_table(2048).max_step_tokens == 0
    wide = parse(["--batch-sizes", "1,16,128"]).bucket_table(2048)
    assert (wide.max_step_tokens, wide.mixed_budget) == (0, 256)
    # a saved table's own limit wins over auto, as its token buckets do; not over the flag
    saved = tmp_path / "table.json"
    replace(parse([]).bucket_table(2048), max_step_tokens=64).save(saved)
    assert parse(["--buckets-file", str(saved)]).bucket_table(2048).mixed_budget == 64
    assert parse(["--buckets-file", str(saved), "--max-step-tokens", "0"]).bucket_table(2048).mixed_budget == 256
    with pytest.raises(SettingsError, match="max_step_tokens must be -1"):
        parse(["--max-step-tokens", "-2"])
    assert parse(["--max-step-tokens", "16"]).bucket_table(2048).mixed_budget == 32  # at least the smallest bucket
    # without mixed steps there is nothing to cap
    assert parse(["--no-mixed-steps", "--max-step-tokens", "64"]).bucket_table(2048).max_step_tokens == 0


def test_cuda_graphs_are_off_by_default_and_only_for_cuda_with_inductor() -> None:
    assert parse([]).cuda_graphs is False
    assert parse(["--device", "cuda", "--cuda-graphs"]).cuda_graphs is True
    assert parse(["--device", "cuda"], {"BUCKETSERVE_CUDA_GRAPHS": "1"}).cuda_graphs is True
    parse(["--device", "cuda", "--cuda-graphs"]).check_cuda_graphs()
    for argv in (["--cuda-graphs"], ["--device", "cuda", "--compile-backend", "eager", "--cuda-graphs"]):
        with pytest.raises(SettingsError, match="--cuda-graphs needs --device cuda"):
            parse(argv).check_cuda_graphs()


@pytest.mark.parametrize("flag", ["--buckets", "--batch-sizes", "--prefill-batch-sizes", "--kv-buckets"])
def test_an_empty_size_list_flag_is_refused_but_an_empty_variable_means_the_default(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--buckets ""` meant the default buckets without a word; the flag now says what is wrong. The environment
    keeps "" as the default (the Helm chart renders an empty list so)."""
    with pytest.raises(SystemExit) as exit_info:
        parse([flag, ""])
    assert exit_info.value.code == 2 and "empty size list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([flag, "64,x"])
    assert "cannot parse size list '64,x'" in capsys.readouterr().err  # not argparse's "invalid parse_sizes value"
    variable = "BUCKETSERVE_" + flag.lstrip("-").replace("-", "_").upper()
    assert parse([], {variable: ""}) == ServerSettings()


def test_a_device_this_torch_cannot_run_is_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from server.config import check_device

    check_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SettingsError, match="--device cuda: this torch sees no CUDA device"):
        check_device("cuda")
    try:
        torch.device("neuron")
    except RuntimeError:
        with pytest.raises(SettingsError, match="--device neuron needs torch-neuronx"):
            check_device("neuron")
    else:
        check_device("neuron")  # a torch with the neuron device (torch-neuronx installed): accepted
