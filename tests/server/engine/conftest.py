"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def reference_model(tiny_llama: str):
    """The tiny checkpoint in transformers, for solo reference runs (its eager generate)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa").eval()
