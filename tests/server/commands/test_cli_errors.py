"""What an operator's mistakes get from the `bucketserve` command line: one line naming the problem and a non-zero
exit, never a traceback (an operator review found model paths, files, an empty prompt, a server that is down and a
device this torch lacks all ending in tracebacks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import main
from tests.support.process import TINY_FLAGS


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_model_paths_that_are_not_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"], capsys)
    assert code == 1 and "no such directory" in err
    code, err = run(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert code == 1 and "has no config.json" in err


def test_missing_files(tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["serve", "--model", tiny_llama, "--buckets-file", str(tmp_path / "none.json")], capsys)
    assert code == 1 and "FileNotFoundError" in err and "none.json" in err
    code, err = run(["plan", "--lengths-file", str(tmp_path / "none.txt")], capsys)
    assert code != 0 and "none.txt" in err


def test_verify_against_a_server_that_is_down(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["verify", "--model", tiny_llama, "--against", "http://127.0.0.1:9"], capsys)
    assert code == 1 and "ConnectError" in err


def test_an_empty_prompt(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["generate", "--model", tiny_llama, *TINY_FLAGS, "--compile-backend", "eager", "--dtype",
                     "float32", "--prompt", ""], capsys)
    assert code == 1 and "BucketError" in err


@pytest.mark.parametrize("device", ["cuda", "neuron"])
def test_a_device_this_torch_lacks(tiny_llama: str, device: str, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    backend = ["--compile-backend", "neuron"] if device == "neuron" else []
    code, err = run(["generate", "--model", tiny_llama, "--device", device, *backend, "--prompt", "hi"], capsys)
    assert code == 2 and f"--device {device}" in err


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "-1"], "--num-prompts"),  # ran every case
    (["--min-agreement", "5"], "--min-agreement"),  # a bar no run can reach
    (["--min-agreement", "nan"], "--min-agreement"),
    (["--max-tokens", "0"], "--max-tokens"),  # a SamplingError's traceback
])
def test_verify_refuses_a_check_other_than_asked(tiny_llama: str, flags: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["verify", "--model", tiny_llama, *flags], capsys)
    assert code == 2 and message in err
