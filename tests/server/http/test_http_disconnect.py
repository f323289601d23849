"""Live uvicorn over the fake engine: client disconnects abort the engine request (streaming and not),
and an engine failure mid-stream ends the stream with an error event instead of a hang or a crash."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterator

import httpx
import pytest
import text_generation
from text_generation import Client as TgiClient

from tests.server.conftest import AppFactory, LiveServer, wait_ready
from tests.support.fake_engine import FakeEngine


@pytest.fixture
def live_fake(make_app: AppFactory) -> Iterator[tuple[LiveServer, FakeEngine]]:
    app, engine, _ = make_app(step_delay=0.02)
    with LiveServer(app) as server:
        wait_ready(engine.is_ready)
        yield server, engine


def eventually(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 100, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}),
    ("/generate_stream", {"inputs": "hello", "parameters": {"max_new_tokens": 100}}),
])
def test_streaming_disconnect_aborts(live_fake: tuple[LiveServer, FakeEngine], route: str, body: dict[str, Any]) -> None:
    server, engine = live_fake
    engine.hold.set()  # nothing is generated: only the disconnect can end the request
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", route, json=body) as r:
            assert r.status_code == 200 and int(r.headers["x-bucket"]) in engine.table.lengths  # before any token
            assert eventually(lambda: engine.num_running() == 1)
    assert eventually(lambda: engine.aborts and engine.aborts[-1][1] == "client"), engine.aborts
    assert engine.num_running() == 0


def test_non_streaming_disconnect_aborts(make_app: AppFactory) -> None:
    """The sequences are aborted as "client", and the HTTP metrics count the request as 499 (nginx's "client
    closed request"), not as the 200 nobody received."""
    app, engine, metrics = make_app(step_delay=0.02)
    with LiveServer(app) as server:
        wait_ready(engine.is_ready)
        engine.hold.set()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 100, "n": 2},
                       timeout=0.5)
        assert eventually(lambda: len(engine.aborts) == 2), engine.aborts
        assert {reason for _, reason in engine.aborts} == {"client"} and engine.num_running() == 0
        assert eventually(lambda: ("http", "/v1/completions", 499) in metrics.calls), metrics.named("http")
        engine.hold.clear()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200
    assert [c for c in metrics.named("http") if c[1] == "/v1/completions"] == [
        ("http", "/v1/completions", 499), ("http", "/v1/completions", 200)]


def test_engine_failure_mid_stream_ends_with_an_error_event(live_fake: tuple[LiveServer, FakeEngine]) -> None:
    server, engine = live_fake
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 100,
                                                             "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            engine.fail("device lost")
            rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    errors = [json.loads(x)["error"] for x in rest[:-1] if "error" in json.loads(x)]
    assert errors and "device lost" in errors[0]["message"] and errors[0]["code"] == "engine_error"


def test_engine_failure_is_a_tgi_generation_error(live_fake: tuple[LiveServer, FakeEngine]) -> None:
    server, engine = live_fake
    stream = TgiClient(server.url, timeout=10).generate_stream("hello", max_new_tokens=100)
    assert next(stream).token.text
    engine.fail("device lost")
    with pytest.raises(text_generation.errors.GenerationError):
        for _ in stream:
            pass
    r = httpx.post(server.url + "/generate", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 503 and r.json()["error_type"] == "overloaded"
    assert httpx.get(server.url + "/health").status_code == 503
