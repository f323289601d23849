"""The Starlette application: routes, error handling, HTTP metrics, optional API-key auth and the
lifespan that starts and stops the engine thread.

Error handling is one place: `HttpMiddleware` turns any exception a route raises into that request's
error response (errors.to_api_error); Starlette's own 404 / 405 go through `http_exception_handler`.

The port opens immediately; loading and warm-up run in the engine thread (GET /ready reports progress).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import ServerSettings
from server.http import routes_misc, routes_openai, routes_tgi
from server.http.errors import ApiError, error_response, exception_response, http_exception_handler
from server.http.routes_openapi import build_openapi, openapi
from server.http.state import AppState

if TYPE_CHECKING:
    from server.engine.interface import EngineAPI
    from server.metrics.hooks import ServedMetrics

log = logging.getLogger("bucketserve.http")

OPEN_PATHS = ("/health", "/ready", "/openapi.json")  # never behind the API key (probes, docs)
# Not counted in requests_total: scrapes and probes are monitoring, not traffic. Counted, a Prometheus scrape
# every 15 s and kubelet probes every few seconds would outnumber a quiet server's requests and dilute its error
# ratio (vLLM's instrumentator leaves out the same handlers).
UNCOUNTED_ROUTES = frozenset({"/metrics", "/health", "/ready"})


def routes() -> list[Route]:
    return [
        Route("/v1/completions", routes_openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes_openai.chat_completions, methods=["POST"]),
        Route("/v1/models", routes_misc.models, methods=["GET"]),
        Route("/v1/models/{model:path}", routes_misc.model, methods=["GET"]),
        Route("/generate", routes_tgi.generate, methods=["POST"]),
        Route("/generate_stream", routes_tgi.generate_stream, methods=["POST"]),
        Route("/", routes_tgi.root, methods=["POST"]),
        Route("/tokenize", routes_misc.tokenize, methods=["POST"]),
        Route("/detokenize", routes_misc.detokenize, methods=["POST"]),
        Route("/health", routes_misc.health, methods=["GET"]),
        Route("/ready", routes_misc.ready, methods=["GET"]),
        Route("/metrics", routes_misc.metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"], include_in_schema=False),
    ]


class HttpMiddleware:
    """Counts every response by route template and status (but scrapes and probes), enforces API keys when
    configured, and answers any exception with that request's error response (never a crash, never a plain-text
    500)."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state
        self.keys = [k.encode() for k in state.settings.api_keys]

    def _authorized(self, scope: Scope) -> bool:
        path = scope.get("path", "")
        if not self.keys or path in OPEN_PATHS or (path == "/metrics" and not self.state.settings.protect_metrics):
            return True
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return any(hmac.compare_digest(token, key) for key in self.keys)

    def _count(self, scope: Scope, status: int) -> None:
        route = scope.get("route")
        path = getattr(route, "path", None) or "/unmatched"
        if path in UNCOUNTED_ROUTES:
            return
        self.state.hooks.http_request(path, status)  # guarded: metrics never break a response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = False

        async def counting_send(message: Message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self._count(scope, int(message["status"]))
            await send(message)

        if not self._authorized(scope):
            err = ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            await error_response(err)(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:  # noqa: BLE001 - the catch-all is the point: one request, one error
            if counted:
                raise  # the response has started (a stream): nothing can be sent in its place
            await exception_response(exc, scope.get("path", ""))(scope, receive, counting_send)
        except BaseException:
            if not counted:
                self._count(scope, 500)
            raise


def create_app(engine: EngineAPI, settings: ServerSettings, metrics: ServedMetrics) -> Starlette:
    state = AppState(engine=engine, settings=settings, metrics=metrics, model_name=engine.model_name)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()  # returns at once; loading and warm-up run in the engine thread
        try:
            yield
        finally:
            # stop() joins the engine thread; keep the loop free meanwhile so pending streams can end.
            await asyncio.to_thread(engine.stop)

    app = Starlette(
        routes=routes(),
        middleware=[Middleware(HttpMiddleware, state=state)],
        exception_handlers={HTTPException: http_exception_handler},
        lifespan=lifespan,
    )
    app.state.bucketserve = state
    app.state.openapi = build_openapi(f"bucketserve ({state.model_name})", "0.1.0")
    return app
