"""The errors of the shape policy: bad sizes, a request too long for the table, a batch too large for it, a full
waiting queue."""

from __future__ import annotations


class BucketError(ValueError):
    """A bucket table was given invalid sizes."""


class PromptTooLongError(ValueError):
    """A prompt (or prompt + generation budget) does not fit the largest bucket or the context."""

    def __init__(self, length: int, limit: int, what: str = "prompt") -> None:
        self.length = length
        self.limit = limit
        self.what = what
        super().__init__(f"{what} has {length} tokens, more than the limit of {limit} tokens")


class BatchTooLargeError(ValueError):
    """More rows than the largest batch bucket."""

    def __init__(self, rows: int, limit: int) -> None:
        self.rows = rows
        self.limit = limit
        super().__init__(f"batch of {rows} rows exceeds the largest batch bucket {limit}")


class QueueFullError(RuntimeError):
    """Admission refused (429): the scheduler's waiting queue is at its request or token limit. The engine adds
    its estimate of when to retry (`retry_after`, seconds); the scheduler alone cannot know it."""

    def __init__(self, reason: str, limit: int, retry_after: float | None = None) -> None:
        self.reason = reason  # "requests" | "tokens"
        self.limit = limit
        self.retry_after = retry_after
        super().__init__(f"server busy: the waiting queue is at its limit of {limit} {reason}")
