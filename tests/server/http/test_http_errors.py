"""The error battery over the fake engine: every bad input gets the right status and an OpenAI-shaped
error body naming the parameter, and the server keeps serving afterwards."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from tests.server.conftest import AppFactory, settings_for, wait_ready
from tests.support.fake_engine import FakeEngine

MSG = [{"role": "user", "content": "hi"}]

# (route, body, expected status, expected param (None: don't care), expected code (None: don't care))
BAD_JSON_BODIES: list[tuple[str, dict[str, Any], int, str | None, str | None]] = [
    ("/v1/completions", {"prompt": "x", "foo": 1, "bar": 2}, 400, "foo", "unknown_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_parameter"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5.0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": "s" * 257}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty", None),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["ok", ""]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [10**6]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt", None),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "w " * 200}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400, "messages.0.x",
     "unknown_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "text": ""}]}]}, 400,
     "messages.0.content.0.type", "unsupported_parameter"),
    # an image or audio part with its own fields is unsupported, not a list of unknown fields
    ("/v1/chat/completions", {"messages": [MSG[0], {"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages.1.content.1.type", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400, "messages.0.content.0.type",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
     400, "messages.0.content.0.x", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": [MSG[0], {"role": "assistant", "tool_calls": [{"id": "1"}]}]}, 400,
     "messages.1.tool_calls", "unsupported_parameter"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content.0.type", "unsupported_parameter"),
    # top_k past int64 (the sampling graph's tensor): a 400, not a failed step (it failed every row of the step)
    ("/v1/completions", {"prompt": "x", "top_k": 2**64}, 400, "top_k", None),
    ("/v1/chat/completions", {"messages": MSG, "top_k": 2**63}, 400, "top_k", None),
    ("/generate", {"inputs": "x", "parameters": {"top_k": 2**63}}, 400, "parameters.top_k", None),
    # more sequences than the queue holds (8 here): the field to shrink is named
    ("/v1/completions", {"prompt": ["a"] * 9}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "a", "n": 9}, 400, "n", None),
    ("/v1/chat/completions", {"messages": [{"role": "bad", "content": "hi"}]}, 400, "messages", "invalid_messages"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format",
     None),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", None),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 1000}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * 300}]}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": MSG, "model": "nope"}, 404, "model", "model_not_found"),
    ("/generate", {"inputs": ""}, 400, "inputs", None),
    ("/generate", {"inputs": "x", "parameters": {"typical_p": 0.5}}, 400, "parameters.typical_p", None),
    ("/generate", {"inputs": "x", "parameters": {"best_of": 2}}, 400, "parameters.best_of", None),
    ("/generate", {"inputs": "x", "parameters": {"watermark": True}}, 400, "parameters.watermark", None),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {}}}}, 400,
     "parameters.grammar", None),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 10**6}}, 400, None, "context_length_exceeded"),
    ("/generate_stream", {"inputs": "x", "parameters": {"top_n_tokens": 50}}, 400, "parameters.top_n_tokens", None),
    ("/", {"inputs": "x", "parameters": {"stop": [""]}}, 400, "parameters.stop", None),
    ("/tokenize", {}, 400, "prompt", None),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt", None),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", None),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", None),
]


def check_error(r: Any, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, FakeEngine]]:
    from server.http.app import create_app
    from tests.server.conftest import FAKE_TABLE, RecordingMetrics
    from tests.support.fake_engine import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    engine = FakeEngine(tok, FAKE_TABLE)
    app = create_app(engine, settings_for(max_waiting_requests=8), RecordingMetrics(FAKE_TABLE))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(engine.is_ready)
        yield client, engine


@pytest.mark.parametrize("route,body,status,param,code", BAD_JSON_BODIES)
def test_bad_parameters(shared: tuple[TestClient, FakeEngine], route: str, body: dict[str, Any], status: int,
                        param: str | None, code: str | None) -> None:
    client, _ = shared
    r = client.post(route, json=body)
    err = check_error(r, status, param, code)
    if code == "context_length_exceeded":
        assert "64" in err["message"] or "128" in err["message"]  # the limit is named
    if route in ("/", "/generate", "/generate_stream"):
        assert r.json()["error_type"] in ("validation", "overloaded")  # what the TGI client keys on


RAW_BODIES = [
    b"{", b"[1, 2]", b"", b"null", b'"text"', b'{"prompt": NaN}', b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": -Infinity}', b'{"prompt": "x", "temperature": 1e999}',
    b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b"\xff\xfe\x00garbage",
    b'{"prompt": "\\ud800"}',
]


@pytest.mark.parametrize("raw", RAW_BODIES, ids=range(len(RAW_BODIES)))
def test_malformed_bodies(shared: tuple[TestClient, FakeEngine], raw: bytes) -> None:
    client, _ = shared
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text  # a lone surrogate is valid JSON; the tokenizer copes
    if r.status_code == 400:
        check_error(r, 400)


SURROGATE = "\ud800".encode("utf-8", "surrogatepass")  # b"\xed\xa0\x80": U+D800 as UTF-8 bytes, unescaped


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", b'{"prompt": "x ' + SURROGATE + b'", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x ' + SURROGATE + b'", "max_tokens": 2, "stream": true}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x' + SURROGATE + b'"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "model": "' + SURROGATE + b'"}'),
    ("/tokenize", b'{"prompt": "' + SURROGATE + b'"}'),
    ("/generate", b'{"inputs": "' + SURROGATE + b'"}'),
])
def test_raw_surrogate_bytes_are_invalid_json(shared: tuple[TestClient, FakeEngine], route: str, body: bytes) -> None:
    """A lone surrogate written as raw UTF-8 bytes (not as a \\u escape) is not UTF-8: a 400 like the escape's,
    where it used to reach the tokenizer (a TypeError: 500) or an error body that could not encode it (a plain-text
    500 and a closed connection)."""
    client, _ = shared
    check_error(client.post(route, content=body, headers={"content-type": "application/json"}), 400,
                code="invalid_json")
    assert client.get("/health").status_code == 200


def test_wrong_routes_and_methods(shared: tuple[TestClient, FakeEngine]) -> None:
    client, _ = shared
    check_error(client.get("/v2/nothing"), 404, code="not_found")
    r = client.get("/v1/completions")
    check_error(r, 405, code="method_not_allowed")
    assert r.headers["allow"] == "POST"
    check_error(client.post("/health"), 405)


def test_body_size_limit(make_app: AppFactory) -> None:
    app, engine, _ = make_app(settings_for(max_body_bytes=1000))
    with TestClient(app) as client:
        wait_ready(engine.is_ready)
        check_error(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413, code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is checked
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        check_error(client.post("/v1/completions", content=chunks()), 413)
        check_error(client.post("/v1/completions", content=b"{}", headers={"content-length": "abc"}), 400)
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_queue_full_is_429_with_retry_after(make_app: AppFactory) -> None:
    app, engine, metrics = make_app(max_waiting=2)
    engine.hold.set()
    with TestClient(app) as client:
        wait_ready(engine.is_ready)
        r = client.post("/v1/completions", json={"prompt": "x", "n": 3})
        check_error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "4"
        assert ("rejected", "queue_full") in metrics.calls
        assert engine.num_running() == 0  # the two admitted before the refusal were aborted
        engine.hold.clear()


def test_unexpected_exception_is_a_500_for_that_request_only(shared: tuple[TestClient, FakeEngine],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    client, engine = shared

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("surprise")

    monkeypatch.setattr(engine, "submit_many", explode)
    err = check_error(client.post("/v1/completions", json={"prompt": "x"}), 500, code="internal_error")
    assert err["type"] == "server_error" and "surprise" not in err["message"]  # no internals leak
    monkeypatch.undo()
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_server_keeps_serving_after_the_battery(shared: tuple[TestClient, FakeEngine]) -> None:
    client, _ = shared
    assert client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hellohello"
    assert json.loads(client.get("/ready").text)["ready"] is True
