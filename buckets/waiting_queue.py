"""The scheduler's waiting queue: requests that have not started, first come first served, with their prompt
tokens counted. Pure Python.

Why a class: the queue's bounds (requests, prompt tokens) refuse a request that would pass either with a 429
(QueueFullError), never drop one, and every way a request leaves the queue (it starts, it is aborted) must take
its tokens off the count; here that bookkeeping is in one place.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from buckets.errors import QueueFullError

if TYPE_CHECKING:
    from buckets.steps import Sequence


class WaitingQueue(deque["Sequence"]):
    """A deque of the waiting sequences, oldest first; `tokens`: their prompt tokens in all."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_waiting_requests and max_waiting_tokens must be positive")
        super().__init__()
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tokens = 0

    def admit(self, seqs: list[Sequence]) -> None:
        """All of `seqs` join the end of the queue, or none of them (QueueFullError: the request or token bound).
        A lone prompt longer than the token bound still joins an empty queue: it is refused only for what waits."""
        tokens = self.tokens
        for i, seq in enumerate(seqs):
            if len(self) + i >= self.max_requests:
                raise QueueFullError("requests", self.max_requests)
            if tokens + seq.prompt_len > self.max_tokens and (self or i):
                raise QueueFullError("tokens", self.max_tokens)
            tokens += seq.prompt_len
        super().extend(seqs)
        self.tokens = tokens

    def popleft(self) -> Sequence:
        seq = super().popleft()
        self.tokens -= seq.prompt_len
        return seq

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        self.tokens -= seq.prompt_len
