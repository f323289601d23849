"""The waiting queue's bounds and its token count through every way a request leaves it."""

from __future__ import annotations

import pytest

from buckets.errors import QueueFullError
from buckets.steps import Sequence
from buckets.waiting_queue import WaitingQueue


def test_the_queue_admits_all_or_none_and_counts_tokens_out_as_they_leave() -> None:
    q = WaitingQueue(max_requests=3, max_tokens=100)
    a, b, c, d = (Sequence(name, n, 4) for name, n in (("a", 10), ("b", 20), ("c", 30), ("d", 70)))
    q.admit([a])
    with pytest.raises(QueueFullError, match="100 tokens"):
        q.admit([c, d])  # 10 + 100 > 100: neither joins
    assert list(q) == [a] and q.tokens == 10
    q.admit([b, c])
    with pytest.raises(QueueFullError, match="3 requests"):
        q.admit([Sequence("e", 1, 4)])
    assert q.popleft() is a and q.tokens == 50  # a request starts
    q.remove(c)  # aborted, or started out of order (a prefill batch of one bucket)
    assert list(q) == [b] and q.tokens == 20


def test_a_lone_prompt_over_the_token_bound_joins_an_empty_queue() -> None:
    q = WaitingQueue(max_requests=2, max_tokens=10)
    q.admit([Sequence("long", 50, 4)])  # refused only for what waits before it
    assert q.tokens == 50
    with pytest.raises(ValueError, match="positive"):
        WaitingQueue(0, 10)
