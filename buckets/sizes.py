"""Size lists (bucket lengths, batch sizes): parsed from the command line, validated, generated as powers of two,
and the smallest size that covers a count. The sizes themselves are the table's (buckets/table.py).
"""

from __future__ import annotations

import argparse

from buckets.errors import BatchTooLargeError, BucketError


def validate_sizes(name: str, values: tuple[int, ...]) -> None:
    """BucketError unless `values` is a non-empty, strictly increasing tuple of positive integers."""
    if not values:
        raise BucketError(f"{name} must not be empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BucketError(f"{name} holds {v!r}; every size must be a positive integer")
    if list(values) != sorted(set(values)):
        raise BucketError(f"{name} {list(values)} must be strictly increasing without duplicates")


def powers_of_two(start: int, stop: int) -> tuple[int, ...]:
    """Powers of two from `start` (rounded up to one) up to `stop`; `stop` itself closes the list
    when it is not a power of two, so the largest bucket always equals the limit."""
    if start < 1 or stop < 1:
        raise BucketError(f"powers_of_two needs positive bounds, got start={start} stop={stop}")
    out: list[int] = []
    v = 1
    while v < start:
        v *= 2
    while v < stop:
        out.append(v)
        v *= 2
    out.append(stop)
    return tuple(out)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse a comma-separated size list from the command line, e.g. "64,128,256"."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise BucketError(f"cannot parse size list {text!r}: {exc}") from exc


def flag_sizes(text: str) -> tuple[int, ...]:
    """An argparse `type` for a size-list flag: parse_sizes, with its error as the flag's own message, and an empty
    list refused (a flag given as "" would otherwise mean its default without a word; leave the flag out for that).
    The BUCKETSERVE_* variables keep "" as the default: the Helm chart renders an empty list so."""
    try:
        sizes = parse_sizes(text)
    except BucketError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("an empty size list (leave the flag out for the defaults)")
    return sizes


def smallest_at_least(sizes: tuple[int, ...], rows: int) -> int:
    """The smallest of `sizes` (increasing) that holds `rows`; BatchTooLargeError when none does."""
    if rows < 1:
        raise BucketError(f"a batch needs at least one row, got {rows}")
    for size in sizes:
        if size >= rows:
            return size
    raise BatchTooLargeError(rows, sizes[-1])
