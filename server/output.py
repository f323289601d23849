"""The one output path of every generation route: a streaming builder and a whole-response builder, both
driven by an `OutputFormat` (OpenAI completions, OpenAI chat, TGI) that only says how to spell things.

Both builders read the same `SequenceRun`s, so a stream and a whole response carry the same text.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.admission import Generation
from server.routes_runs import EventStream, RunResult, TextDelta, collect_all, merge


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
