"""Black-box: a real uvicorn server over the REAL engine (tiny random Llama, eager backend), driven by the
official `openai` client (sync and async) and Hugging Face's `text-generation` client."""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry
from text_generation import AsyncClient as TgiAsyncClient
from text_generation import Client as TgiClient

from server.http.app import create_app
from server.metrics.prometheus import Metrics
from tests.server.conftest import LiveServer, wait_ready
from tests.support.tiny import TINY_SERVED_TABLE, TINY_TABLE, tiny_engine, tiny_settings

INFO = {"model": "tiny", "dtype": "float32", "device": "cpu", "compile_backend": "eager"}
NO_EOS = {"ignore_eos": True}  # vLLM extension, sent through extra_body: makes max_tokens exact


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, Any, Metrics]]:
    metrics = Metrics(CollectorRegistry(), TINY_SERVED_TABLE, info=INFO)
    engine = tiny_engine(tmp_path_factory.mktemp("engine"), metrics=metrics)
    assert engine.table == TINY_SERVED_TABLE
    with LiveServer(create_app(engine, tiny_settings(), metrics)) as server:
        wait_ready(engine.is_ready, timeout=120)
        yield server, engine, metrics


@pytest.fixture(scope="module")
def oai(live: tuple[LiveServer, Any, Metrics]) -> openai.OpenAI:
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(oai: openai.OpenAI) -> str:
    (card,) = oai.models.list().data
    return card.id


def test_models_card(oai: openai.OpenAI, model_id: str) -> None:
    card = oai.models.list().data[0]
    assert card.owned_by == "bucketserve" and card.model_extra == {"max_model_len": TINY_TABLE.context_length}


def test_completion_stream_equals_non_stream_and_length(oai: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = dict(model=model_id, prompt="the cat sat on the mat", max_tokens=12, temperature=0,
                              extra_body=NO_EOS)
    whole = oai.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens == 6
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage == whole.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_headers_report_the_bucket(live: tuple[LiveServer, Any, Metrics], oai: openai.OpenAI, model_id: str) -> None:
    raw = oai.completions.with_raw_response.create(model=model_id, prompt="the cat sat", max_tokens=2)
    bucket = TINY_TABLE.length_for(3)
    assert raw.headers["x-bucket"] == str(bucket) and raw.headers["x-padded-tokens"] == str(bucket - 3)


def test_same_seed_same_text(oai: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = dict(model=model_id, prompt="hello world", max_tokens=16, temperature=1.0,
                              extra_body=NO_EOS)
    a, b = (oai.completions.create(seed=1234, **kw).choices[0].text for _ in range(2))
    others = {oai.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


def test_stop_is_honoured(oai: openai.OpenAI, model_id: str) -> None:
    kw: dict[str, Any] = dict(model=model_id, prompt="a b c", max_tokens=24, temperature=0, extra_body=NO_EOS)
    text = oai.completions.create(**kw).choices[0].text
    words = text.split()
    stop = words[len(words) // 2]
    cut = text[: text.index(stop)]
    got = oai.completions.create(stop=[stop], **kw).choices[0]
    assert got.text == cut and got.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == cut


def test_chat_sync_and_async_streaming(oai: openai.OpenAI, live: tuple[LiveServer, Any, Metrics],
                                       model_id: str) -> None:
    kw: dict[str, Any] = dict(model=model_id, messages=[{"role": "user", "content": "hello world"}],
                              max_tokens=10, temperature=0, extra_body=NO_EOS)
    whole = oai.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10

    async def stream() -> str:
        client = openai.AsyncOpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0)
        out = []
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            out.extend(c.delta.content or "" for c in chunk.choices)
        await client.close()
        return "".join(out)

    assert asyncio.run(stream()) == whole.choices[0].message.content


def test_text_generation_client(live: tuple[LiveServer, Any, Metrics]) -> None:
    client = TgiClient(live[0].url, timeout=60)
    resp = client.generate("the cat sat", max_new_tokens=8)
    assert resp.details.generated_tokens <= 8 and resp.details.finish_reason in ("length", "eos_token")
    streamed = [r for r in client.generate_stream("the cat sat", max_new_tokens=8)]
    assert "".join(r.token.text for r in streamed if not r.token.special) == resp.generated_text
    assert streamed[-1].generated_text == resp.generated_text
    sampled = [client.generate("the cat", max_new_tokens=8, do_sample=True, seed=7).generated_text for _ in range(2)]
    assert sampled[0] == sampled[1]

    async def agen() -> tuple[str, str]:
        ac = TgiAsyncClient(live[0].url, timeout=60)
        whole = (await ac.generate("the cat sat", max_new_tokens=8)).generated_text
        parts = [r.token.text async for r in ac.generate_stream("the cat sat", max_new_tokens=8) if not r.token.special]
        return whole, "".join(parts)

    whole, streamed_text = asyncio.run(agen())
    assert whole == streamed_text == resp.generated_text


def test_bad_inputs_keep_the_server_serving(live: tuple[LiveServer, Any, Metrics], oai: openai.OpenAI,
                                            model_id: str) -> None:
    url = live[0].url
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model_id, prompt="w1 " * 100, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and str(TINY_TABLE.max_length) in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model_id, prompt="x", max_tokens=TINY_TABLE.context_length)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=model_id, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model_id, messages=[])
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=model_id, prompt="x", extra_body={"nonsense": 1})
    assert info.value.param == "nonsense"
    with httpx.Client(base_url=url) as h:
        for raw in (b"{", b'{"prompt": NaN}', b"[]"):
            assert h.post("/v1/completions", content=raw).status_code == 400
        assert h.post("/v1/completions", content=b"x" * (tiny_settings().max_body_bytes + 1)).status_code == 413
        assert h.get("/health").status_code == 200
        assert h.get("/ready").status_code == 200
    ok = oai.completions.create(model=model_id, prompt="the cat", max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert ok.usage is not None and ok.usage.completion_tokens == 3


def test_metrics_show_admissions_and_http(live: tuple[LiveServer, Any, Metrics]) -> None:
    text = httpx.get(live[0].url + "/metrics").text
    assert 'bucketserve_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "bucketserve_requests_over_limit_total" in text


def test_text_generation_client_chat(live: tuple[LiveServer, Any, Metrics], oai: openai.OpenAI,
                                     model_id: str) -> None:
    """The TGI client's chat() (model "tgi", every field sent, nulls included) parses our chat response.
    Its streaming chat cannot parse the OpenAI `data: [DONE]` terminator, so only non-streaming is checked."""
    from text_generation.types import Message

    client = TgiClient(live[0].url, timeout=60)
    whole = client.chat(messages=[Message(role="user", content="hello world")], max_tokens=6, seed=1,
                        temperature=0.5)
    ref = oai.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hello world"}],
                                      max_tokens=6, seed=1, temperature=0.5)
    assert whole.choices[0].message.content == ref.choices[0].message.content
    assert whole.system_fingerprint and whole.choices[0].finish_reason in ("length", "stop")
