"""Fixtures for the HTTP-layer tests: a byte-level BPE tokenizer, the fake engine, an app with real
Metrics that also records the HTTP hooks, a TestClient, and a live uvicorn server in a thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.testclient import TestClient

from buckets import BucketTable
from server.app import create_app
from server.config import ServerSettings
from server.metrics import Metrics
from tests.server.fake_engine import CHAT_TEMPLATE, FakeEngine, build_tokenizer

FAKE_TABLE = BucketTable(lengths=(16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1,), context_length=128)


class RecordingMetrics(Metrics):
    """The real Metrics (so label validation runs) plus a log of the HTTP-layer hook calls."""

    def __init__(self, table: BucketTable) -> None:
        super().__init__(CollectorRegistry(), table, info={"model": "test", "dtype": "float32", "device": "cpu", "compile_backend": "eager"})
        self.calls: list[tuple[Any, ...]] = []

    def request_admitted(self, bucket: int, prompt_tokens: int) -> None:
        self.calls.append(("admitted", bucket, prompt_tokens))
        super().request_admitted(bucket, prompt_tokens)

    def request_rejected(self, reason: str) -> None:
        self.calls.append(("rejected", reason))
        super().request_rejected(reason)

    def request_over_limit(self) -> None:
        self.calls.append(("over_limit",))
        super().request_over_limit()

    def http_request(self, endpoint: str, status: int) -> None:
        self.calls.append(("http", endpoint, status))
        super().http_request(endpoint, status)

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def slow_tokenizer() -> Any:
    """A slow (pure Python) tokenizer that needs no files: ByT5's, one token per UTF-8 byte, so every
    multi-byte character is split across tokens; it exercises the fallback detokenizer."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    assert not tok.is_fast
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def slow_client(slow_tokenizer: Any) -> Iterator[TestClient]:
    """A TestClient over the fake engine with the slow tokenizer."""
    engine = FakeEngine(slow_tokenizer, FAKE_TABLE)
    app = create_app(engine, ServerSettings(), RecordingMetrics(FAKE_TABLE))
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(engine.is_ready)
        yield client


AppFactory = Callable[..., tuple[Starlette, FakeEngine, RecordingMetrics]]


@pytest.fixture
def make_app(tokenizer: Any) -> AppFactory:
    def make(settings: ServerSettings | None = None, **engine_kw: Any) -> tuple[Starlette, FakeEngine, RecordingMetrics]:
        engine = FakeEngine(tokenizer, FAKE_TABLE, **engine_kw)
        metrics = RecordingMetrics(FAKE_TABLE)
        return create_app(engine, settings or ServerSettings(), metrics), engine, metrics

    return make


def wait_ready(is_ready: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_ready():
        if time.monotonic() > deadline:
            raise TimeoutError("engine did not become ready")
        time.sleep(0.01)


@pytest.fixture
def fake(make_app: AppFactory) -> Iterator[tuple[TestClient, FakeEngine, RecordingMetrics]]:
    """A TestClient over the fake engine, warmed (lifespan ran, engine ready)."""
    app, engine, metrics = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        wait_ready(engine.is_ready)
        yield client, engine, metrics


@pytest.fixture
def client(fake: tuple[TestClient, FakeEngine, RecordingMetrics]) -> TestClient:
    return fake[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """uvicorn in a background thread (signal handlers are skipped off the main thread)."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_ready(lambda: self.server.started, timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def settings_for(**overrides: Any) -> ServerSettings:
    return replace(ServerSettings(), **overrides)
