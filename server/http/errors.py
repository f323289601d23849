"""Every error the HTTP layer returns, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

One table (`ERROR_TABLE`) maps the domain exceptions the engine and the sampling code raise onto
(status, type, code); `ApiError` carries errors the HTTP layer finds itself (bad JSON, bad fields).
Nothing a client sends may become a 500: `app.HttpMiddleware` turns every exception into one response
for that request only, through `to_api_error` here.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from buckets import BucketError, PromptTooLongError
from models.params import SamplingError
from server.engine.interface import (
    DrainingError,
    EngineDeadError,
    EngineNotReadyError,
    InvalidTokenError,
    QueueFullError,
)
from server.http.limits import TGI_PATHS

log = logging.getLogger("bucketserve.http")

INVALID = "invalid_request_error"
UNAVAILABLE = "service_unavailable_error"


class ClientDisconnectedError(Exception):
    """The client went away before a non-streaming answer was ready; its sequences were aborted."""


# Domain exception -> (HTTP status, error type, error code). Subclasses match through the MRO.
ERROR_TABLE: dict[type[Exception], tuple[int, str, str]] = {
    PromptTooLongError: (400, INVALID, "context_length_exceeded"),
    SamplingError: (400, INVALID, "invalid_parameter"),
    InvalidTokenError: (400, INVALID, "invalid_parameter"),
    BucketError: (400, INVALID, "invalid_parameter"),  # e.g. a chat template that renders no tokens
    QueueFullError: (429, "rate_limit_error", "queue_full"),
    EngineNotReadyError: (503, UNAVAILABLE, "not_ready"),
    DrainingError: (503, UNAVAILABLE, "draining"),
    EngineDeadError: (503, UNAVAILABLE, "engine_dead"),
    # Nobody reads this answer; the status is for the HTTP metrics and logs (nginx's "client closed request"),
    # where an aborted request would otherwise count as a 200.
    ClientDisconnectedError: (499, INVALID, "client_closed_request"),
}

# TGI's client picks its exception class from a top-level `error_type`; TGI routes add it.
TGI_ERROR_TYPES: dict[int, str] = {400: "validation", 404: "validation", 413: "validation", 429: "overloaded",
                                   503: "overloaded"}


class ApiError(Exception):
    """An error found by the HTTP layer; rendered as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> ApiError:
    """400 naming the offending parameter."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_parameter")


def unsupported(param: str, detail: str = "") -> ApiError:
    extra = f" ({detail})" if detail else ""
    return ApiError(400, f"{param} is not supported by this server{extra}", param=param, code="unsupported_parameter")


def _retry_after(exc: Exception) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) from the exception's estimate; none when it has none
    (a dead engine will not come back by waiting)."""
    seconds = getattr(exc, "retry_after", None)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return {}
    if not math.isfinite(seconds):
        seconds = 1.0
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def to_api_error(exc: Exception) -> ApiError:
    """Map any exception onto an ApiError; unknown ones become a 500 for this request only."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            status, kind, code = ERROR_TABLE[cls]
            param = getattr(exc, "param", None)
            if isinstance(exc, PromptTooLongError):
                param = "max_tokens" if exc.what != "prompt" else "prompt"
                message = (
                    f"This model's maximum context length is {exc.limit} tokens: the {exc.what} has "
                    f"{exc.length} tokens. Shorten the prompt or lower max_tokens."
                )
            else:
                message = str(exc) or cls.__name__
            headers = _retry_after(exc)
            return ApiError(status, message, type=kind, param=param, code=code, headers=headers)
    log.exception("unexpected error while serving a request", exc_info=exc)
    return ApiError(500, "internal server error: " + type(exc).__name__, type="server_error", code="internal_error")


def from_validation_error(exc: ValidationError) -> ApiError:
    """pydantic errors -> one 400 naming the first offending field (or every unknown field)."""
    errors = exc.errors(include_url=False, include_input=False)
    extra = [".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        return ApiError(
            400,
            f"unknown field(s): {', '.join(extra)}; this server rejects parameters it does not implement",
            param=extra[0],
            code="unknown_parameter",
        )
    first = errors[0]
    loc = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "is required"
    if len({tuple(e["loc"][:1]) for e in errors}) == 1 and len(errors) > 1:
        msg = f"invalid value ({'; '.join(sorted({e['msg'] for e in errors}))})"
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_parameter")


def _is_union_tag(part: object) -> bool:
    # pydantic names union members in the location ("prompt", "list[int]", 0); hide the member name.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "function-after"))


def error_response(err: ApiError, *, tgi: bool = False) -> JSONResponse:
    body = err.body()
    if tgi:
        body["error_type"] = TGI_ERROR_TYPES.get(err.status, "generation")
    return JSONResponse(body, status_code=err.status, headers=err.headers)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (unknown route, wrong method) in the same error shape."""
    assert isinstance(exc, HTTPException)
    kinds = {404: ("not_found_error", "not_found"), 405: (INVALID, "method_not_allowed")}
    kind, code = kinds.get(exc.status_code, (INVALID, "http_error"))
    message = f"{request.method} {request.url.path}: {exc.detail}"
    err = ApiError(exc.status_code, message, type=kind, code=code, headers=dict(exc.headers or {}))
    return error_response(err)


def exception_response(exc: Exception, path: str) -> JSONResponse:
    """The one response for an exception raised while serving `path` (TGI routes add `error_type`)."""
    return error_response(to_api_error(exc), tgi=path in TGI_PATHS)
