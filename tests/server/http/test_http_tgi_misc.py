"""TGI routes (JSON shapes parsed with text_generation.types) and the small routes: health, ready,
models, tokenize, detokenize, metrics, openapi; over the fake engine."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.testclient import TestClient
from text_generation.types import Response as TgiResponse
from text_generation.types import StreamResponse

from tests.server.conftest import AppFactory, wait_ready
from tests.support.fake_engine import FakeEngine


def sse_payloads(text: str) -> list[Any]:
    return [json.loads(line[5:]) for line in text.split("\n") if line.startswith("data:")]


def tgi_body(inputs: str, **params: Any) -> dict[str, Any]:
    return {"inputs": inputs, "parameters": {"details": True, **params}}


def test_generate_shape_matches_the_tgi_client_types(client: TestClient) -> None:
    r = client.post("/generate", json=tgi_body("the cat", max_new_tokens=4, decoder_input_details=True,
                                               top_n_tokens=2))
    assert r.status_code == 200 and r.headers["x-bucket"] == "16"
    resp = TgiResponse(**r.json())
    assert resp.generated_text == "the catthe cat"
    d = resp.details
    assert d.finish_reason == "length" and d.generated_tokens == 4 and d.seed is None
    assert [t.text for t in d.tokens] == ["the", " cat", "the", " cat"] and d.tokens[0].logprob == -0.5
    assert [t.text for t in d.prefill] == ["the", " cat"]
    assert d.top_tokens is not None and len(d.top_tokens[0]) == 2
    # POST / is what the client calls: a list of one response
    r = client.post("/", json=tgi_body("the cat", max_new_tokens=4))
    assert TgiResponse(**r.json()[0]).generated_text == "the catthe cat"


def test_generate_stream_matches_generate(client: TestClient) -> None:
    for params in ({"max_new_tokens": 9}, {"max_new_tokens": 9, "do_sample": True, "seed": 4},
                   {"max_new_tokens": 20, "stop": ["mat"]}):
        whole = client.post("/generate", json=tgi_body("the cat sat on the mat", **params)).json()
        r = client.post("/generate_stream", json=tgi_body("the cat sat on the mat", **params))
        events = [StreamResponse(**p) for p in sse_payloads(r.text)]
        assert "".join(e.token.text for e in events if not e.token.special) == whole["generated_text"]
        assert events[-1].generated_text == whole["generated_text"]
        assert events[-1].details is not None and events[-1].details.finish_reason == whole["details"]["finish_reason"]
        assert all(e.details is None for e in events[:-1])
        r = client.post("/", json={**tgi_body("the cat sat on the mat", **params), "stream": True})
        assert sse_payloads(r.text)[-1]["generated_text"] == whole["generated_text"]


def test_tgi_finish_reasons_and_full_text(client: TestClient) -> None:
    body = client.post("/generate", json=tgi_body("the cat sat on the mat", max_new_tokens=20, stop=["mat"])).json()
    assert body["generated_text"] == "the cat sat on the mat"  # TGI keeps the stop sequence
    assert body["details"]["finish_reason"] == "stop_sequence"
    body = client.post("/generate", json=tgi_body("hello</s>", max_new_tokens=20)).json()
    assert body["details"]["finish_reason"] == "eos_token" and body["generated_text"] == "hello"
    assert body["details"]["tokens"][-1]["special"] is True
    body = client.post("/generate", json=tgi_body("a b", max_new_tokens=2, return_full_text=True, seed=3,
                                                  do_sample=True)).json()
    assert body["generated_text"].startswith("a b") and body["details"]["seed"] == 3
    body = client.post("/generate", json={"inputs": "a b", "parameters": {"max_new_tokens": 2}}).json()
    assert "details" not in body


def test_tgi_truncate_keeps_last_tokens(fake: tuple[TestClient, FakeEngine, Any], tokenizer: Any) -> None:
    client, engine, _ = fake
    client.post("/generate", json=tgi_body("the cat sat on the mat", max_new_tokens=1, truncate=2))
    assert engine.submitted[-1][0] == tokenizer("the cat sat on the mat")["input_ids"][-2:]


def test_models_tokenize_detokenize(client: TestClient, tokenizer: Any) -> None:
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == "fake-model" and card["owned_by"] == "bucketserve" and card["max_model_len"] == 128
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert client.get("/v1/models/other").status_code == 404
    r = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert r == {"tokens": tokenizer("hello world")["input_ids"], "count": 2, "max_model_len": 128}
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert r["count"] == len(r["tokens"]) > 2
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "<user>hi\n<assistant>"


def test_health_and_ready_during_warmup_then_ready(make_app: AppFactory) -> None:
    app, engine, _ = make_app(warmup_delay=0.05)
    with TestClient(app) as client:
        r = client.get("/ready")
        assert r.status_code == 503 and r.headers["retry-after"]
        body = r.json()
        assert body["ready"] is False and body["graphs_total"] == engine.table.num_graphs
        assert body["graphs_done"] < body["graphs_total"] and body["error"]["code"] == "not_ready"
        assert client.get("/health").status_code == 200  # alive while warming
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        wait_ready(engine.is_ready)
        assert client.get("/ready").json()["ready"] is True
        engine.begin_drain()
        r = client.get("/ready")
        assert r.status_code == 503 and r.json()["draining"] is True
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"] == "2"


def test_health_fails_when_engine_dies(fake: tuple[TestClient, FakeEngine, Any]) -> None:
    client, engine, _ = fake
    engine.fail("CUDA exploded")
    deadline = time.monotonic() + 5
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    r = client.get("/health")
    assert r.status_code == 503 and "CUDA exploded" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_metrics_endpoint_and_http_hooks(fake: tuple[TestClient, FakeEngine, Any]) -> None:
    client, _, metrics = fake
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1000})
    client.get("/no/such/route")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'bucketserve_requests_total{endpoint="/v1/completions",status="200"} 1.0' in r.text
    assert ("http", "/v1/completions", 400) in metrics.calls and ("http", "/unmatched", 404) in metrics.calls
    assert metrics.named("over_limit") and ("admitted", 16, 1) in metrics.calls


def test_openapi_document_lists_routes_and_schemas(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream", "/tokenize"):
        assert path in doc["paths"]
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert schema["additionalProperties"] is False and "prompt" in schema["required"]


def test_api_keys(make_app: AppFactory) -> None:
    from tests.server.conftest import settings_for

    app, engine, _ = make_app(settings_for(api_keys=("sekrit",)))
    with TestClient(app) as client:
        wait_ready(engine.is_ready)
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
