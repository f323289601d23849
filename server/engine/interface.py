"""What crosses between the engine thread and the event loop: the `EngineAPI` the HTTP layer drives (the
real `Engine` and the tests' fake both satisfy it), the `Tokenizer` it uses, and the records and errors
that travel. Pure Python (no torch): the HTTP layer imports them without loading the model stack."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, AsyncIterator, Callable, Mapping, Protocol, Sequence

from buckets import BucketTable
from buckets.scheduler import QueueFullError
from models.params import SamplingParams

__all__ = ["DrainingError", "EngineAPI", "EngineDeadError", "EngineNotReadyError", "FinishReason", "InvalidTokenError",
           "QueueFullError", "RequestHandle", "TokenEvent", "Tokenizer", "WarmupProgress", "deliver_step"]


class FinishReason(StrEnum):
    """Why a sequence ended. The engine reports the first four; the HTTP layer adds STOP_STRING when it
    matched a stop string. A StrEnum, so the engine's plain strings compare equal to the members."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    STOP_STRING = "stop_string"

    @property
    def openai(self) -> str:
        """OpenAI's spelling: a stop string is a plain "stop"."""
        return "stop" if self is FinishReason.STOP_STRING else self.value

    @property
    def tgi(self) -> str | None:
        """TGI's spelling; None for the endings TGI reports as an error (abort, error)."""
        return _TGI_FINISH.get(self)


_TGI_FINISH = {FinishReason.STOP: "eos_token", FinishReason.STOP_STRING: "stop_sequence",
               FinishReason.LENGTH: "length"}


class EngineNotReadyError(RuntimeError):
    """503: the model is still loading or warming up."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__("the model is still warming up; retry later")


class DrainingError(RuntimeError):
    """503: the server is shutting down and admits no new work."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__("the server is draining and accepts no new requests")


class InvalidTokenError(ValueError):
    """400: a prompt token id the model's embedding table does not have."""

    def __init__(self, token_id: int, limit: int) -> None:
        self.token_id = token_id
        self.limit = limit
        super().__init__(f"token id {token_id} is outside the model's vocabulary [0, {limit})")


class EngineDeadError(RuntimeError):
    """503: the engine thread has stopped; /health fails too."""


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None


@dataclass(frozen=True)
class WarmupProgress:
    graphs_done: int
    graphs_total: int
    seconds: float  # since the engine began (model load and warm-up), frozen once warm-up ends
    ready: bool
    draining: bool
    failed: str | None
    mesh: dict[str, Any] | None = None  # tensor parallel: layout and per-rank compilations


@dataclass(eq=False)
class RequestHandle:
    """The event loop's view of one request: an async stream of TokenEvents ending with a finish reason."""

    request_id: str
    prompt_tokens: int
    bucket: int
    padded_tokens: int
    loop: asyncio.AbstractEventLoop = field(repr=False)
    _abort: Callable[[str, str], None] = field(repr=False)
    # set where the client matches stop strings (submit_many's `settled_by_client`): RequestBook.settle
    _settle: Callable[[str, bool], None] | None = field(default=None, repr=False)
    _queue: asyncio.Queue[TokenEvent] = field(init=False, repr=False)
    _done: bool = field(default=False, init=False)
    # Prompt tokens whose K/V a prefix-cached slot already held (set by the engine thread when the prompt starts,
    # before any of its events are delivered).
    cached_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._queue = asyncio.Queue()

    def push(self, events: list[TokenEvent]) -> None:
        """Called from the engine thread: one hop to the event loop per step."""
        try:
            self.loop.call_soon_threadsafe(self.deliver, events)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    def deliver(self, events: list[TokenEvent]) -> None:
        """On the event loop: queue events for the reader."""
        for event in events:
            self._queue.put_nowait(event)

    def abort(self, reason: str = "client") -> None:
        if not self._done:
            self._abort(self.request_id, reason)

    @property
    def settled_by_client(self) -> bool:
        """The client matches stop strings, so a `length` end is counted once it says whether one matched."""
        return self._settle is not None

    def settle(self, stop_string: bool) -> None:
        """On the event loop, once the client has seen the end (or given up): whether a stop string ended the
        text. Why: a stop string that completes on the last allowed token makes the answer's finish reason `stop`
        where the engine saw `length`; the engine holds such an end's accounting (metrics, request log) until
        this. Once per request; a no-op for a handle without stop strings or an end the engine did not hold."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle(self.request_id, stop_string)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not self._done:
            event = await self._queue.get()
            if event.finish_reason is not None:
                self._done = True
            yield event


def deliver_step(batches: list[tuple[RequestHandle, list[TokenEvent]]]) -> None:
    """From the engine thread: one hop to the event loop for a whole step (not one per request or token)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[TokenEvent]]]] = {}
    for handle, events in batches:
        by_loop.setdefault(handle.loop, []).append((handle, events))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_now, items)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


def _deliver_now(items: list[tuple[RequestHandle, list[TokenEvent]]]) -> None:
    for handle, events in items:
        handle.deliver(events)


class Tokenizer(Protocol):
    """What the HTTP layer asks of the model's tokenizer (a transformers tokenizer satisfies it)."""

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Mapping[str, Any]: ...
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = True) -> Any: ...


class EngineAPI(Protocol):
    """What the HTTP layer needs from the engine: identity and limits, lifecycle, health and admission.
    Satisfied by server.engine.engine.Engine and by tests/support/fake_engine.FakeEngine (mypy checks both)."""

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def table(self) -> BucketTable: ...
    @property
    def model_name(self) -> str: ...
    @property
    def vocab_limit(self) -> int: ...  # the one bound on client token ids (HTTP and engine alike)

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def progress(self) -> WarmupProgress: ...
    def is_ready(self) -> bool: ...
    def is_alive(self) -> bool: ...
    def submit_many(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str], *,
                    settled_by_client: bool = False) -> list[RequestHandle]:
        """Queue every sequence or none (the refusal propagates: QueueFullError, PromptTooLongError, ...).
        settled_by_client: the caller matches stop strings and calls each handle's `settle` once it has read it."""
        ...
