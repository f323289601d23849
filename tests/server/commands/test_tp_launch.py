"""Launching the ranks: layout and model checks before anything starts, settings handed to followers, and
a server whose second rank never joins exiting non-zero with the missing rank named."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from server.commands.tp_launch import run_ranked, settings_from_env, settings_to_env, start_ranks
from server.config import ServerSettings, SettingsError
from tests.models.tp_support import free_port
from tests.support.process import ServerProcess
from tests.support.tiny import build_tiny_checkpoint, tiny_settings


def _never(*_: object) -> int:
    raise AssertionError("lead must not run")


def test_settings_validate_the_tensor_parallel_fields() -> None:
    with pytest.raises(SettingsError, match="tensor_parallel_size must be >= 1, got 0"):
        ServerSettings(tensor_parallel_size=0)
    with pytest.raises(SettingsError, match="tp_timeout must be positive"):
        ServerSettings(tp_timeout=0)


def test_followers_get_the_same_settings() -> None:
    settings = tiny_settings(tensor_parallel_size=2, api_keys=("k",), buckets=(8, 16))
    assert settings_from_env(settings_to_env(settings)) == settings


def test_single_rank_runs_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launch = start_ranks(tiny_settings())
    assert launch.spec is None and launch.followers == {}


def test_world_size_that_does_not_match_the_layout_is_refused(monkeypatch, capsys, tiny_llama: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert run_ranked(tiny_settings(model=tiny_llama, tensor_parallel_size=2), _never) == 1
    assert "need 2 processes, but the world size is 3" in capsys.readouterr().err


def test_heads_not_divisible_are_refused_before_any_rank_starts(monkeypatch, capsys, tiny_llama: str) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_ranked(tiny_settings(model=tiny_llama, tensor_parallel_size=4), _never) == 1
    assert "num_key_value_heads 2 is not divisible by the tensor-parallel size 4" in capsys.readouterr().err


def test_a_presharded_checkpoint_is_refused_before_any_rank_starts(monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = Path(build_tiny_checkpoint(tmp_path / "tiny"))
    tensors = load_file(path / "model.safetensors")
    tensors = {k: (v[: v.shape[0] // 2].clone() if k.endswith("k_proj.weight") else v) for k, v in tensors.items()}
    save_file(tensors, path / "model.safetensors")
    assert run_ranked(tiny_settings(model=str(path), tensor_parallel_size=2), _never) == 1
    assert "the checkpoint is already sharded" in capsys.readouterr().err


def test_a_rank_that_never_joins_makes_the_server_exit_nonzero(tiny_llama: str, tmp_path: Path, monkeypatch) -> None:
    # torchrun's variables for rank 0 of 2, and no rank 1 anywhere.
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    flags = ["--compile-backend", "eager", "--dtype", "float32", "--buckets", "8,16", "--max-model-len", "64",
             "--kv-buckets", "64", "--num-threads", "1", "--compile-cache-dir", "none", "--tensor-parallel-size", "2",
             "--tp-timeout", "2"]
    server = ServerProcess(tiny_llama, *flags, log_path=tmp_path / "serve.log")
    try:
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "ranks [1] of 2 did not join the mesh" in log and "(joined: [0])" in log

