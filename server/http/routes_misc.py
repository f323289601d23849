"""GET /health, /ready, /metrics, /v1/models; POST /tokenize, /detokenize."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.errors import UNAVAILABLE, ApiError, error_response
from server.http.protocol import DetokenizeRequest, TokenizeRequest, parse
from server.http.state import AppState, check_ids, encode_text, render_chat, state_of


async def health(request: Request) -> Response:
    """Liveness: the engine thread is running (it may still be warming up)."""
    state = state_of(request)
    if state.engine.is_alive():
        return JSONResponse({"status": "ok"})
    failed = state.engine.progress().failed
    detail = f": {failed}" if failed else ""
    return error_response(ApiError(503, f"the engine thread is not running{detail}", type=UNAVAILABLE,
                                   code="engine_dead"))


async def ready(request: Request) -> Response:
    """Readiness: 200 once every graph is warm and the server is not draining; 503 with progress before."""
    state = state_of(request)
    progress = state.engine.progress()
    body: dict[str, Any] = {
        "ready": False,
        "graphs_done": progress.graphs_done,
        "graphs_total": progress.graphs_total,
        "seconds": round(progress.seconds, 3),
        "draining": progress.draining,
        "failed": progress.failed,
    }
    if progress.mesh is not None:
        body["mesh"] = progress.mesh
    if state.engine.is_ready():
        body["ready"] = True
        return JSONResponse(body)
    if progress.failed:
        why, code = f"the engine failed: {progress.failed}", "engine_failed"
    elif progress.draining:
        why, code = "the server is draining", "draining"
    else:
        why, code = f"warming up: {progress.graphs_done}/{progress.graphs_total} graphs", "not_ready"
    body.update(ApiError(503, why, type=UNAVAILABLE, code=code).body())
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"} if code != "engine_failed" else {})


async def metrics(request: Request) -> Response:
    payload, content_type = state_of(request).metrics.render()
    return Response(payload, headers={"content-type": content_type})


def _model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "bucketserve",
            "max_model_len": state.engine.table.context_length}


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(state_of(request))]})


async def model(request: Request) -> Response:
    state = state_of(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))


async def tokenize(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, TokenizeRequest, state.body_limit)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_parameter")
    if req.messages is not None:
        if not req.messages:
            raise ApiError(400, "messages: must not be empty", param="messages", code="invalid_parameter")
        dicts = [m.as_template_dict(i) for i, m in enumerate(req.messages)]
        tokens = render_chat(state.tokenizer, dicts, add_generation_prompt=req.add_generation_prompt)
    else:
        tokens = encode_text(state.tokenizer, req.prompt or "", add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.table.context_length})


async def detokenize(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, DetokenizeRequest, state.body_limit)
    state.check_model(req.model)
    check_ids(state, req.tokens, "tokens")
    return JSONResponse({"prompt": str(state.tokenizer.decode(req.tokens))})
