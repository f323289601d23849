"""Consuming engine token streams: one `SequenceRun` per submitted sequence turns TokenEvents into text
deltas (incremental detokenization + stop strings), for streaming and non-streaming alike, so both
produce the same text. Also: merging several runs into one stream, client-disconnect handling, and an
SSE response that aborts its sequences when the client goes away."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from starlette.requests import Request

from server.engine.interface import FinishReason, Tokenizer
from server.http.detokenizer import incremental_detokenizer
from server.http.errors import ClientDisconnectedError
from server.http.stop_strings import StopMatcher

if TYPE_CHECKING:
    from server.engine.interface import RequestHandle

log = logging.getLogger("bucketserve.http")
T = TypeVar("T")

STOP_STRING = FinishReason.STOP_STRING


@dataclass(frozen=True)
class TextDelta:
    """What one engine event adds to a sequence: its text, its token and, on the last one, why it ended."""

    text: str
    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass
class RunResult:
    text: str = ""
    steps: list[TextDelta] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.ABORT
    error: str | None = None

    @property
    def tokens(self) -> list[TextDelta]:
        return [s for s in self.steps if s.token_id is not None]


class SequenceRun:
    def __init__(
        self, handle: RequestHandle, tokenizer: Tokenizer, prompt_ids: Sequence[int], stops: Sequence[str],
        hold_back: bool = True,
    ) -> None:
        self.handle = handle
        self.detok = incremental_detokenizer(tokenizer, prompt_ids)
        self.stopper = StopMatcher(stops, hold_back=hold_back)
        self.finished = False

    def abort(self, reason: str = "client") -> None:
        if not self.finished:
            self.finished = True
            self.handle.abort(reason)
        self.handle.settle(self.stopper.matched is not None)  # an end the engine held is counted now

    async def steps(self) -> AsyncIterator[TextDelta]:
        """Deltas until the sequence ends; the last one carries the finish reason."""
        try:
            async for ev in self.handle:
                text = ""
                if ev.token_id is not None:
                    text, matched = self.stopper.feed(self.detok.add(ev.token_id))
                    if matched:
                        self.abort(STOP_STRING)  # the engine may still have tokens in flight
                        yield TextDelta(text, ev.token_id, ev.logprob, ev.top_logprobs, STOP_STRING)
                        return
                if ev.finish_reason is None:
                    yield TextDelta(text, ev.token_id, ev.logprob, ev.top_logprobs)
                    continue
                tail, matched = self.stopper.feed(self.detok.flush())
                text += tail + self.stopper.flush()
                reason = STOP_STRING if matched else FinishReason(ev.finish_reason)
                self.finished = True
                self.handle.settle(matched)
                yield TextDelta(text, ev.token_id, ev.logprob, ev.top_logprobs, reason, ev.error)
                return
            self.finished = True  # the engine promises a final event; be safe if it ends early
            yield TextDelta("", None, finish_reason=FinishReason.ABORT,
                            error="token stream ended without a finish reason")
        finally:
            self.abort("client")

    async def collect(self) -> RunResult:
        result = RunResult()
        async for step in self.steps():
            result.steps.append(step)
            if step.finish_reason is not None:
                result.finish_reason, result.error = step.finish_reason, step.error
        result.text = self.stopper.text
        return result


async def merge(runs: Sequence[SequenceRun]) -> AsyncIterator[tuple[int, TextDelta]]:
    """Interleave the deltas of several runs as they arrive; (run index, delta)."""
    if len(runs) == 1:
        try:
            async for step in runs[0].steps():
                yield 0, step
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, end the stream cleanly
            log.exception("sequence failed")
            yield 0, _failed(exc)
        return
    queue: asyncio.Queue[tuple[int, TextDelta | None]] = asyncio.Queue()

    async def pump(i: int, run: SequenceRun) -> None:
        try:
            async for step in run.steps():
                await queue.put((i, step))
        except Exception as exc:  # noqa: BLE001 - report the failure on this choice only
            log.exception("sequence %d failed", i)
            await queue.put((i, _failed(exc)))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        remaining = len(runs)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.abort("client")


def _failed(exc: Exception) -> TextDelta:
    return TextDelta("", None, finish_reason=FinishReason.ERROR, error=type(exc).__name__)


async def collect_all(request: Request, runs: Sequence[SequenceRun]) -> list[RunResult]:
    """Non-streaming: wait for every run, aborting them all if the client disconnects first."""
    disconnected = False

    def abort_all() -> None:
        nonlocal disconnected
        disconnected = True
        for r in runs:
            r.abort("client")

    try:
        results = await until_disconnect(request, asyncio.gather(*(r.collect() for r in runs)), abort_all)
    except BaseException:
        for r in runs:  # one sequence failed: free the others' slots too, nobody reads them
            r.abort("error")
        raise
    if disconnected:  # the runs ended with "abort": an answer nobody reads is not a 200
        raise ClientDisconnectedError("the client disconnected before the answer was ready")
    return results


async def until_disconnect(request: Request, work: Awaitable[T], on_disconnect: Callable[[], object]) -> T:
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            on_disconnect()  # the runs now end with "abort"; nobody will read the answer
        return await task
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
