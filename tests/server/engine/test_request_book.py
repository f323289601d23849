"""Retry-After from the engine's completion rate (server/engine/request_book.py)."""

from __future__ import annotations

from server.engine.request_book import retry_after_seconds


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
