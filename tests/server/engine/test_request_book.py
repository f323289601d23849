"""Retry-After from the engine's completion rate, and ends the client settles (server/engine/request_book.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from server.engine.active_request import ActiveRequest
from server.engine.interface import RequestHandle
from server.engine.request_book import HELD_TIMEOUT_S, RequestBook, retry_after_seconds


def test_a_burst_after_idle_time_gives_its_own_rate() -> None:
    """40 completions in the last 3 s, nothing before: ~13 a second, so 40 waiting drain in ~3 s (the rate over
    the whole minute said 60)."""
    now = 1000.0
    burst = [now - 3.0 + 3.0 * i / 40 for i in range(40)]
    assert retry_after_seconds(burst, now, waiting=40) == 3.0


def test_steady_completions_over_the_minute() -> None:
    now = 1000.0
    steady = [now - 59.5 + i for i in range(60)]  # one a second
    assert retry_after_seconds(steady, now, waiting=9) == 10.0
    assert retry_after_seconds(steady, now, waiting=500) == 60.0  # capped
    assert retry_after_seconds(steady, now, waiting=0) == 1.0  # at least 1


def test_nothing_finished_lately() -> None:
    now = 1000.0
    assert retry_after_seconds([], now, waiting=3) == 5.0
    assert retry_after_seconds([now - 120.0, now - 61.0], now, waiting=3) == 5.0  # older than a minute
    # one completion 30 s ago and nothing since: slow, ~30 s a request
    assert retry_after_seconds([now - 30.0], now, waiting=1) == 60.0


class _Finishes:
    """The metrics hooks the book calls, recording how requests finished."""

    def __init__(self) -> None:
        self.finished: list[str] = []

    def first_token(self, bucket: int, seconds: float) -> None:
        pass

    def prefill_chunks(self, chunks: int) -> None:
        pass

    def request_finished(self, bucket: int, seconds: float, output_tokens: int, inter_token: list[float],
                         finish_reason: str) -> None:
        self.finished.append(finish_reason)


def _held_request(book: RequestBook, settles: bool) -> ActiveRequest:
    loop = asyncio.new_event_loop()
    loop.close()  # the handle's loop is never used here
    handle = RequestHandle("r-0", 3, 8, 5, loop, lambda rid, reason: None, book.settle if settles else None)
    seq = SimpleNamespace(bucket=8, num_chunks=1, num_generated=4, prompt_len=3)
    return ActiveRequest(handle, seq, None, [1, 2, 3], arrival=0.0, deadline=float("inf"))  # type: ignore[arg-type]


@pytest.mark.parametrize("client_first", [False, True])
@pytest.mark.parametrize("stop_string", [False, True])
def test_a_length_end_waits_for_the_client(client_first: bool, stop_string: bool) -> None:
    """A request whose client matches stop strings ends by length: it is counted once, whichever thread (the
    engine's accounting of the last token, the client's settle) comes second, as `stop` where a stop string
    matched on that token."""
    metrics = _Finishes()
    book = RequestBook(None, metrics, 0.0, 1)  # type: ignore[arg-type]  # no scheduler needed here
    active = _held_request(book, settles=True)
    with book.lock:
        book.hold(active, "length")
    if client_first:
        active.handle.settle(stop_string)
        assert metrics.finished == []
        book.account_token(active, 1.0, "length")
    else:
        book.account_token(active, 1.0, "length")
        assert metrics.finished == []
        active.handle.settle(stop_string)
    assert metrics.finished == ["stop" if stop_string else "length"]
    active.handle.settle(True)  # once only
    assert metrics.finished == ["stop" if stop_string else "length"] and not book._held


@pytest.mark.parametrize("settles, reason", [(False, "length"), (True, "stop")])
def test_other_ends_are_counted_at_once(settles: bool, reason: str) -> None:
    """No stop strings, or an end by EOS: the engine counts the end with its last token, as before."""
    metrics = _Finishes()
    book = RequestBook(None, metrics, 0.0, 1)  # type: ignore[arg-type]
    active = _held_request(book, settles=settles)
    with book.lock:
        book.hold(active, reason)
    book.account_token(active, 1.0, reason)
    assert metrics.finished == [reason] and not book._held


def test_a_held_end_nobody_settles_is_counted_after_the_timeout() -> None:
    """A handle dropped unread (a code path that never settles) must not lose its end: the engine thread counts it,
    as it ended, once HELD_TIMEOUT_S have passed."""
    metrics = _Finishes()
    book = RequestBook(None, metrics, 0.0, 1)  # type: ignore[arg-type]
    active = _held_request(book, settles=True)
    with book.lock:
        book.hold(active, "length")
    book.account_token(active, 100.0, "length")
    book.sweep_held(100.0 + HELD_TIMEOUT_S / 2)
    assert metrics.finished == [] and book._held
    book.sweep_held(100.0 + HELD_TIMEOUT_S + 1)
    assert metrics.finished == ["length"] and not book._held
    active.handle.settle(True)  # too late: nothing more is counted
    assert metrics.finished == ["length"]
