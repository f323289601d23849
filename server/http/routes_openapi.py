"""GET /openapi.json: an OpenAPI 3.1 document assembled from the pydantic request models, so the schema
the server validates against and the one it publishes cannot drift apart."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.protocol import DetokenizeRequest, TokenizeRequest
from server.http.protocol_openai import ChatCompletionRequest, CompletionRequest
from server.http.protocol_tgi import TgiRequest

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {"400": "Invalid request", "404": "Unknown model or route", "413": "Body too large",
                  "429": "Queue full (Retry-After)", "503": "Not ready or draining (Retry-After)"}

# (path, method, request model or None, summary, streams)
ROUTES: list[tuple[str, str, type[BaseModel] | None, str, bool]] = [
    ("/v1/completions", "post", CompletionRequest, "OpenAI text completion", True),
    ("/v1/chat/completions", "post", ChatCompletionRequest, "OpenAI chat completion", True),
    ("/generate", "post", TgiRequest, "TGI generate", False),
    ("/generate_stream", "post", TgiRequest, "TGI generate, server-sent events", True),
    ("/", "post", TgiRequest, "TGI compatible root: a list of one response, or a stream", True),
    ("/tokenize", "post", TokenizeRequest, "Tokenize a prompt or chat messages", False),
    ("/detokenize", "post", DetokenizeRequest, "Token ids to text", False),
    ("/v1/models", "get", None, "The served model", False),
    ("/health", "get", None, "Liveness (engine thread alive)", False),
    ("/ready", "get", None, "Readiness (warmed and not draining) with warm-up progress", False),
    ("/metrics", "get", None, "Prometheus metrics", False),
]

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def _error_responses() -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/Error"}
    return {code: {"description": text, "content": {"application/json": {"schema": ref}}}
            for code, text in ERROR_STATUSES.items()}


def build_openapi(title: str, version: str) -> dict[str, Any]:
    models = [m for _, _, m, _, _ in ROUTES if m is not None]
    _, top = models_json_schema([(m, "validation") for m in dict.fromkeys(models)], ref_template=REF)
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, Any] = {}
    for path, method, model, summary, streams in ROUTES:
        ok_content: dict[str, Any] = {"application/json": {"schema": {}}}
        if streams:
            ok_content["text/event-stream"] = {"schema": {"type": "string"}}
        if path == "/metrics":
            ok_content = {"text/plain": {"schema": {"type": "string"}}}
        op: dict[str, Any] = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_') or 'root'}",
                              "responses": {"200": {"description": "OK", "content": ok_content}}}
        if model is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
            op["responses"].update(_error_responses())
        elif path in ("/health", "/ready"):
            op["responses"]["503"] = {"description": "Not alive / not ready",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}
        paths.setdefault(path, {})[method] = op
    paths["/v1/models/{model}"] = {"get": {
        "summary": "One model card", "operationId": "get_model",
        "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": {}}}},
                      "404": _error_responses()["404"]}}}
    return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
            "components": {"schemas": schemas}}


async def openapi(request: Request) -> Response:
    doc = request.app.state.openapi
    return JSONResponse(doc)
