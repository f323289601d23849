"""Admission: the checks one request's sequences get before the engine sees them, and their submission
together (`Engine.submit_many`: all queued or none). What it returns, a `Generation`, is what the output
path reads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from buckets import PromptTooLongError
from models.params import SamplingParams
from server.engine.interface import DrainingError, EngineNotReadyError, QueueFullError
from server.http.errors import bad_param
from server.http.runs import SequenceRun
from server.http.state import AppState, check_ids

if TYPE_CHECKING:
    from server.engine.interface import RequestHandle


@dataclass
class Generation:
    """One admitted request: a run per sequence, its id and the headers every answer to it carries."""

    id: str
    runs: list[SequenceRun]
    handles: list[RequestHandle]
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def headers(self) -> dict[str, str]:
        """x-bucket: the largest length bucket any sequence used; x-padded-tokens: pad tokens summed over
        every sequence of the request (see docs/http.md)."""
        return {"x-bucket": str(max(h.bucket for h in self.handles)),
                "x-padded-tokens": str(sum(h.padded_tokens for h in self.handles))}

    def abort_all(self) -> None:
        for r in self.runs:
            r.abort("client")


def admit(state: AppState, prompts: Sequence[list[int]], params: Sequence[SamplingParams], stops: Sequence[str],
          request_id: str, *, hold_back: bool = True, many: str = "n") -> Generation:
    """Check and submit one sequence per (prompt, params). The engine checks each against the bucket table
    once, and queues all of them or none (its refusal propagates, mapped by errors.ERROR_TABLE). `many`: the
    field a request of too many sequences is told to shrink (n, or the prompt list where n is 1)."""
    limit = state.settings.max_waiting_requests
    if len(prompts) > limit:
        raise bad_param(many, f"this request asks for {len(prompts)} sequences; the limit is {limit}")
    for p in params:
        check_ids(state, p.stop_token_ids, "stop_token_ids")
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        handles = state.engine.submit_many(list(prompts), list(params), ids, settled_by_client=any(stops))
    except Exception as exc:
        _count_rejection(state, exc)
        raise
    for h in handles:
        state.hooks.request_admitted(h.bucket, h.prompt_tokens)
    runs = [SequenceRun(h, state.tokenizer, p, stops, hold_back=hold_back) for h, p in zip(handles, prompts)]
    return Generation(request_id, runs, handles)


def _count_rejection(state: AppState, exc: BaseException) -> None:
    m = state.hooks
    if isinstance(exc, PromptTooLongError):
        m.request_over_limit()
    elif isinstance(exc, QueueFullError):
        m.request_rejected("queue_full")
    elif isinstance(exc, EngineNotReadyError):
        m.request_rejected("not_ready")
    elif isinstance(exc, DrainingError):
        m.request_rejected("draining")
