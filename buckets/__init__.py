"""Pure-Python shape policy: bucket table, scheduler and planner (no torch, no HTTP)."""

from __future__ import annotations

from buckets.sizes import flag_sizes
from buckets.table import (
    BatchTooLargeError,
    BucketError,
    BucketTable,
    GraphKey,
    PromptTooLongError,
    parse_sizes,
    powers_of_two,
)

__all__ = [
    "BatchTooLargeError",
    "BucketError",
    "BucketTable",
    "GraphKey",
    "PromptTooLongError",
    "flag_sizes",
    "parse_sizes",
    "powers_of_two",
]
