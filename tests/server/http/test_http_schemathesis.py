"""Property-based fuzzing of every operation in /openapi.json (schemathesis, positive and negative
examples) against a live server over the fake engine: no input may produce a 5xx."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from server.http.app import create_app
from server.http.routes_openapi import build_openapi
from tests.server.conftest import FAKE_TABLE, LiveServer, RecordingMetrics, settings_for, wait_ready
from tests.support.fake_engine import FakeEngine, build_tokenizer

Live = tuple[LiveServer, FakeEngine, RecordingMetrics]


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    engine = FakeEngine(build_tokenizer(tmp_path_factory.mktemp("tok")), FAKE_TABLE, step_delay=0.0005)
    metrics = RecordingMetrics(FAKE_TABLE)
    app = create_app(engine, settings_for(max_waiting_requests=16), metrics)
    with LiveServer(app) as server:
        wait_ready(engine.is_ready)
        yield server, engine, metrics


# The document the server publishes (test_openapi_matches_the_served_document checks they are equal);
# built without a server because schemathesis parametrizes at collection time.
DOC = build_openapi("bucketserve (fake-model)", "0.1.0")
schema = schemathesis.openapi.from_dict(DOC)


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_produces_a_server_error(case: Any, live_server: Live) -> None:
    case.call_and_validate(base_url=live_server[0].url, checks=[not_a_server_error], timeout=30)


def test_openapi_matches_the_served_document(live_server: Live) -> None:
    assert httpx.get(live_server[0].url + "/openapi.json").json() == DOC


def test_server_still_healthy_after_fuzzing(live_server: Live) -> None:
    server, engine, metrics = live_server
    assert httpx.get(server.url + "/health").status_code == 200
    assert engine.is_alive()
    # the fuzzing reached both sides of validation on the generation routes
    seen = {(c[1], c[2]) for c in metrics.named("http")}
    for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
        assert (route, 200) in seen and (route, 400) in seen, sorted(seen)
    assert not any(status >= 500 for _, status in seen)
