"""The requests an engine holds, and how each one ends: the scheduler (queue and slots), the engine-side
record of every admitted request, and the accounting of finished ones (metrics, request log, Retry-After).

Shared by the event loop (admission, client aborts) and the engine thread (steps). `lock` guards the
scheduler and `active`; a method takes it itself unless its docstring says "lock held".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from buckets.scheduler import ChunkStep, MixedStep, PrefillStep, Scheduler, Step
from server.engine.active_request import ActiveRequest
from server.engine.interface import TokenEvent
from server.metrics.safe_hooks import SafeHooks


def retry_after_seconds(finished: Iterable[float], now: float, waiting: int) -> float:
    """Seconds (1-60) until a request queued behind `waiting` others is likely to start: the backlog over the
    completion rate of the last minute, counted from its first completion (a rate over the whole minute would
    count the idle time before a burst: a queue that drained in 3 s was told to come back in 60). 5 s when
    nothing finished in the last minute."""
    recent = sorted(t for t in finished if now - t < 60.0)
    if not recent:
        return 5.0
    rate = len(recent) / max(now - recent[0], 1.0)
    return float(min(60, max(1, round((waiting + 1) / rate))))


HELD_TIMEOUT_S = 60.0  # a held end the client has not settled by then is counted as the engine ended it


@dataclass
class _HeldEnd:
    """A `length` end whose accounting waits for two threads: the engine's (the last token's own accounting, then
    `active`/`at` set) and the client's (`stop_string` set by RequestHandle.settle). Whichever comes second counts
    it, so the count never depends on which thread runs first."""

    active: ActiveRequest | None = None
    at: float = 0.0
    stop_string: bool | None = None


class RequestBook:
    def __init__(self, scheduler: Scheduler, metrics: SafeHooks, request_timeout: float, max_batch: int,
                 log_tokenizer: Any = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.max_batch = max_batch
        self.log_tokenizer = log_tokenizer  # set: request ends are logged with their text
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)  # the engine thread waits on it for work
        self.active: dict[str, ActiveRequest] = {}
        self._finished_times: deque[float] = deque(maxlen=256)  # completion times, for Retry-After
        self._held: dict[str, _HeldEnd] = {}  # `length` ends the client settles (see hold)

    def retry_after(self) -> float:
        """Seconds until a queued request is likely to start, from the measured completion rate."""
        return retry_after_seconds(self._finished_times, time.monotonic(), self.scheduler.num_waiting)

    def ids(self) -> list[str]:
        with self.lock:
            return list(self.active)

    def abort(self, request_id: str, reason: str, message: str | None = None) -> None:
        """Thread-safe; frees the slot before the next step. The stream ends with finish_reason 'abort'."""
        with self.lock:
            active = self.active.pop(request_id, None)
            if active is None:
                return
            self.scheduler.abort(request_id)
        active.handle.push([TokenEvent(None, None, (), "abort", message)])  # first: nothing may prevent it
        # A stop string is a normal end for the client ("stop"); everything else is an abort.
        self.account_end(active, reason, "stop" if reason == "stop_string" else "abort")

    def finish_error(self, request_id: str, message: str) -> None:
        """The request ends with an error event (its step or its sampling failed, or the engine did)."""
        with self.lock:
            active = self.active.pop(request_id, None)
            self.scheduler.abort(request_id)
        if active is not None:
            active.handle.push([TokenEvent(None, None, (), "error", message)])
            self.account_end(active, "error", "error")

    def fail_all(self, message: str) -> None:
        """The engine cannot continue: every request ends with an error event."""
        for request_id in self.ids():
            self.finish_error(request_id, message)

    def hold(self, active: ActiveRequest, reason: str) -> None:
        """Lock held, as the engine ends a request (before its last event goes out): where the client matches
        stop strings, a `length` end is counted only once it has settled (RequestHandle.settle), since a stop
        string completed by the last token makes the answer `stop`."""
        if reason == "length" and active.handle.settled_by_client:
            self._held[active.handle.request_id] = _HeldEnd()

    def account_token(self, active: ActiveRequest, now: float, reason: str | None) -> None:
        held = self._held.get(active.handle.request_id) if reason is not None else None
        if held is None:
            active.on_token(now, reason, self.metrics, self.log_tokenizer)
            if reason is not None:
                self._finished_times.append(now)
            return
        active.on_token(now, None, self.metrics, self.log_tokenizer)  # the token; its end waits for the client
        with self.lock:
            held.active, held.at = active, now
            if held.stop_string is None:
                return
            del self._held[active.handle.request_id]
        self._count_held(held)

    def settle(self, request_id: str, stop_string: bool) -> None:
        """From the event loop (RequestHandle.settle): whether a stop string ended the request's text."""
        with self.lock:
            held = self._held.get(request_id)
            if held is None:
                return
            held.stop_string = stop_string
            if held.active is None:
                return  # the engine thread counts it after its own accounting of the last token
            del self._held[request_id]
        self._count_held(held)

    def sweep_held(self, now: float) -> None:
        """Engine thread, between steps: count, as the engine ended them, the held ends whose client has not
        settled within HELD_TIMEOUT_S (a code path that drops a handle unread must not lose its count)."""
        if not self._held:
            return
        with self.lock:
            stale = [rid for rid, held in self._held.items()
                     if held.active is not None and now - held.at > HELD_TIMEOUT_S]
            ends = [self._held.pop(rid) for rid in stale]
        for held in ends:
            held.stop_string = False
            self._count_held(held)

    def _count_held(self, held: _HeldEnd) -> None:
        assert held.active is not None
        held.active.finish("stop" if held.stop_string else "length", held.at, self.metrics, self.log_tokenizer)
        self._finished_times.append(held.at)

    def account_end(self, active: ActiveRequest, abort_reason: str, finish_reason: str) -> None:
        active.on_end(abort_reason, finish_reason, self.metrics, self.log_tokenizer)

    def expired(self) -> list[str]:
        """Lock held: the requests past their deadline (aborted by the caller, outside the lock)."""
        if self.request_timeout <= 0:
            return []
        now = time.monotonic()
        return [rid for rid, active in self.active.items() if now >= active.deadline]

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is waiting or running (used by graceful drain)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not self.active:
                    return True
            time.sleep(0.05)
        return False

    def publish_load(self) -> None:
        running = self.scheduler.num_running
        self.metrics.set_load(running, self.scheduler.num_waiting, self.max_batch - running)

    def prompts(self, step: Step | None) -> dict[str, list[int]]:
        """Lock held: the prompts a step reads (a decode step reads none); a prefill or mixed step's requests that
        start with it are counted started (their queue time, what prefix caching reused)."""
        if isinstance(step, ChunkStep):
            return {step.seq.request_id: self.active[step.seq.request_id].prompt_ids}
        if not isinstance(step, (PrefillStep, MixedStep)):
            return {}
        now = time.monotonic()
        prompts = {}
        for seq in step.seqs if isinstance(step, PrefillStep) else [p.seq for p in step.pieces]:
            active = self.active[seq.request_id]
            prompts[seq.request_id] = active.prompt_ids
            if not active.started:  # a mixed step's piece may continue a prompt begun earlier
                active.started = True
                active.handle.cached_tokens = seq.cached  # read by the event loop after this step's events
                self.metrics.request_started(seq.bucket, now - active.arrival)
                if self.scheduler.prefix_caching:
                    self.metrics.prefix_cache(seq.prompt_len, seq.cached)
        return prompts
