"""The one output path of every generation route: a streaming builder and a whole-response builder, both
driven by an `OutputFormat` (OpenAI completions, OpenAI chat, TGI) that only says how to spell things.

Both builders read the same `SequenceRun`s, so a stream and a whole response carry the same text.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Iterable, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.http.admission import Generation
from server.http.runs import RunResult, TextDelta, collect_all, merge


class OutputFormat(Protocol):
    """How one API family frames a generation."""

    def opening(self) -> Iterable[bytes]:
        """Events sent before the first token (echoed prompts, role deltas)."""

    def event(self, index: int, delta: TextDelta) -> bytes | None:
        """The event for one delta of choice `index`; None when there is nothing to send."""

    def closing(self) -> Iterable[bytes]:
        """Events sent after every choice ended (usage, [DONE])."""

    def body(self, results: list[RunResult]) -> Any:
        """The JSON body of a whole response (raises ApiError when generation failed)."""


def stream_response(gen: Generation, fmt: OutputFormat) -> Response:
    """Server-sent events as the choices generate; the sequences are aborted when the client leaves."""

    async def events() -> AsyncIterator[bytes]:
        for chunk in fmt.opening():
            yield chunk
        async for index, delta in merge(gen.runs):
            event = fmt.event(index, delta)
            if event is not None:
                yield event
        for chunk in fmt.closing():
            yield chunk

    return EventStream(events(), gen.abort_all, gen.headers)


async def whole_response(request: Request, gen: Generation, fmt: OutputFormat) -> Response:
    """One JSON body once every choice ended (all aborted if the client disconnects first)."""
    results = await collect_all(request, gen.runs)
    return JSONResponse(fmt.body(results), headers=gen.headers)


# -- server-sent events ----------------------------------------------------------------------------
def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStream(StreamingResponse):
    """text/event-stream that always listens for the client going away (whatever the ASGI spec
    version), stops the generator, and calls `on_close` so unfinished sequences are aborted."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        headers = {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client closed the connection mid-send
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
