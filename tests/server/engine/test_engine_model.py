"""EngineModel's construction: what it says about settings the model cannot honour."""

from __future__ import annotations

import logging

import pytest

from server.config import ServerSettings
from server.engine.model import EngineModel


def test_a_max_model_len_above_the_model_limit_is_capped_with_a_warning(
        tiny_llama: str, caplog: pytest.LogCaptureFixture) -> None:
    """The tiny model has 512 positions: --max-model-len 4096 serves 512 and says so (it was capped silently)."""
    with caplog.at_level(logging.WARNING):
        model = EngineModel(ServerSettings(max_model_len=4096, dtype="float32"), tiny_llama)
    assert model.table.context_length == 512
    assert any("--max-model-len 4096" in r.getMessage() and "512" in r.getMessage() for r in caplog.records)


def test_the_default_max_model_len_is_capped_without_a_warning(tiny_llama: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        model = EngineModel(ServerSettings(dtype="float32"), tiny_llama)
    assert model.table.context_length == 512
    assert not any("max-model-len" in r.getMessage() for r in caplog.records)
