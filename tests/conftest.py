"""Shared fixtures: tiny random-weight checkpoints built once per session (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: build_tiny_checkpoint(Path(root) / arch, arch=arch) for arch in ("llama", "qwen2", "gpt2")}
