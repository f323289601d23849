"""OpenAI routes over the fake engine (greedy = echo of the prompt's tokens, sampled = seeded RNG)."""

from __future__ import annotations

import json
from typing import Any

from starlette.testclient import TestClient

from tests.support.fake_engine import FakeEngine


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body; asserts it ends with [DONE]."""
    datas = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def completion(client: TestClient, **body: Any) -> Any:
    r = client.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r


def streamed_text(events: list[Any], index: int = 0) -> str:
    return "".join(c["text"] for e in events for c in e["choices"] if c["index"] == index)


def test_completion_greedy_echo_length_usage_and_headers(client: TestClient) -> None:
    r = completion(client, prompt="hello world", max_tokens=5)
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    (choice,) = body["choices"]
    assert choice["text"] == "hello worldhello worldhello"  # 5 echoed tokens: "hello", " world", ...
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert r.headers["x-bucket"] == "16" and r.headers["x-padded-tokens"] == "14"


def test_stream_equals_non_stream_and_usage_chunk(client: TestClient) -> None:
    for body in ({"prompt": "emoji 😀 🚀 party", "max_tokens": 12}, {"prompt": "the cat", "max_tokens": 7, "seed": 3,
                                                                    "temperature": 0.8}):
        whole = completion(client, **body).json()
        r = completion(client, stream=True, stream_options={"include_usage": True}, **body)
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-bucket"] == "16"
        events = sse_events(r.text)
        assert streamed_text(events) == whole["choices"][0]["text"]
        assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
        assert all(e["usage"] is None for e in events[:-1])


def test_same_seed_same_text_different_seed_differs(client: TestClient) -> None:
    texts = [completion(client, prompt="x", max_tokens=10, temperature=1.0, seed=s).json()["choices"][0]["text"]
             for s in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]


def test_stop_string_cuts_and_aborts(fake: tuple[TestClient, FakeEngine, Any]) -> None:
    client, engine, _ = fake
    r = completion(client, prompt="the cat sat on the mat", max_tokens=20, stop=["mat", "zzz"])
    choice = r.json()["choices"][0]
    assert choice["text"] == "the cat sat on the " and choice["finish_reason"] == "stop"
    assert any(reason == "stop_string" for _, reason in engine.aborts)
    events = sse_events(completion(client, prompt="the cat sat on the mat", max_tokens=20, stop="mat",
                                   stream=True).text)
    assert streamed_text(events) == "the cat sat on the "


def test_eos_gives_stop_and_ignore_eos_continues(client: TestClient) -> None:
    body = completion(client, prompt="hello</s>", max_tokens=10).json()
    assert body["choices"][0] == {**body["choices"][0], "text": "hello", "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 2  # the EOS token counts
    body = completion(client, prompt="hello</s>", max_tokens=3, ignore_eos=True).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"] == "hellohellohello"


def test_stop_token_ids(client: TestClient, tokenizer: Any) -> None:
    world = tokenizer(" world")["input_ids"][0]
    body = completion(client, prompt="hello world", max_tokens=10, stop_token_ids=[world]).json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"] == "hello world"


def test_token_id_prompts_lists_and_n(fake: tuple[TestClient, FakeEngine, Any], tokenizer: Any) -> None:
    client, engine, metrics = fake
    ids = tokenizer("the cat")["input_ids"]
    hello = tokenizer("hello")["input_ids"]
    body = completion(client, prompt=[ids, hello], max_tokens=2, n=2, temperature=1.0, seed=5).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(ids) + 1 and body["usage"]["completion_tokens"] == 8
    seeds = [p.seed for _, p in engine.submitted[-4:]]
    assert seeds == [5, 6, 5, 6]
    assert len(metrics.named("admitted")) >= 4
    body = completion(client, prompt=ids, max_tokens=2).json()
    assert body["choices"][0]["text"] == "the cat"
    r = client.post("/v1/completions", json={"prompt": [ids, "hello"]})  # OpenAI does not mix kinds either
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_multi_choice_stream_matches_non_stream(client: TestClient) -> None:
    body = {"prompt": ["a b", "the cat"], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    whole = completion(client, **body).json()
    events = sse_events(completion(client, stream=True, **body).text)
    for c in whole["choices"]:
        assert streamed_text(events, c["index"]) == c["text"]


def test_echo_and_logprobs(client: TestClient) -> None:
    body = completion(client, prompt="the cat", max_tokens=2, echo=True).json()
    assert body["choices"][0]["text"] == "the catthe cat"
    events = sse_events(completion(client, prompt="the cat", max_tokens=2, echo=True, stream=True).text)
    assert streamed_text(events) == "the catthe cat"
    lp = completion(client, prompt="the cat", max_tokens=2, logprobs=2).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["the", " cat"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["text_offset"] == [0, 3] and len(lp["top_logprobs"][0]) == 2


def test_chat_roundtrip_stream_and_logprobs(client: TestClient) -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 0}
    r = client.post("/v1/chat/completions", json=req)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "<user>hi\n"}  # echo of the rendered template's tokens
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 9
    r = client.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["choices"][0]["delta"]["content"] == ""
    assert "".join(c["delta"]["content"] or "" for e in events for c in e["choices"]) == msg["content"]
    assert events[-1]["usage"] == body["usage"]
    r = client.post("/v1/chat/completions", json={**req, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 9 and content[0]["logprob"] == -0.5 and len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())


def test_chat_defaults_max_tokens_to_remaining_context(fake: tuple[TestClient, FakeEngine, Any]) -> None:
    client, engine, _ = fake
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                                  "max_completion_tokens": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                              "stop": "\n"})
    prompt, params = engine.submitted[-1]
    assert params.max_tokens == engine.table.context_length - len(prompt)


def test_chat_content_parts_and_model_name(client: TestClient) -> None:
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    for model in ("fake-model", "tgi", None):
        r = client.post("/v1/chat/completions", json={"model": model, "max_tokens": 9, "temperature": 0,
                                                      "messages": [{"role": "user", "content": parts}]})
        assert r.json()["choices"][0]["message"]["content"] == "<user>hi\n"


def test_stream_equals_non_stream_with_a_slow_tokenizer(slow_client: TestClient) -> None:
    """The fallback detokenizer (slow tokenizer, one token per byte: every multi-byte character split)."""
    for body in ({"prompt": "emoji 😀 🚀 日本", "max_tokens": 23}, {"prompt": "the cat", "max_tokens": 7, "seed": 3,
                                                                  "temperature": 0.8, "n": 2}):
        whole = completion(slow_client, **body).json()
        events = sse_events(completion(slow_client, stream=True, **body).text)
        for c in whole["choices"]:
            assert streamed_text(events, c["index"]) == c["text"]
    assert "😀" in completion(slow_client, prompt="emoji 😀 🚀 日本", max_tokens=23).json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "日本 😀"}], "max_tokens": 20, "temperature": 0}
    whole = slow_client.post("/v1/chat/completions", json=chat).json()
    events = sse_events(slow_client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    streamed = "".join(c["delta"]["content"] or "" for e in events for c in e["choices"])
    assert streamed == whole["choices"][0]["message"]["content"] and "日本" in streamed
