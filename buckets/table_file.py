"""A bucket table's file (`--buckets-file`, the planner's output): JSON fields read back into a BucketTable, every
field checked for its type, unknown fields refused."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from buckets.errors import BucketError

if TYPE_CHECKING:
    from buckets.table import BucketTable


def from_dict(cls: type[BucketTable], data: dict[str, object]) -> BucketTable:
    """`data` (BucketTable.to_dict's shape; missing fields take their defaults) -> a table of class `cls`."""
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise BucketError(f"unknown bucket fields: {sorted(unknown)}")
    if "lengths" not in data:
        raise BucketError("a bucket table needs 'lengths'")

    def ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
        value = data.get(name, list(default))
        if not isinstance(value, list):
            raise BucketError(f"{name} must be a list of integers, got {value!r}")
        return tuple(value)

    def integer(name: str) -> int:
        value = data.get(name, 0)
        if not isinstance(value, int):
            raise BucketError(f"{name} must be an integer, got {value!r}")
        return value

    return cls(
        lengths=ints("lengths", ()),
        batch_sizes=ints("batch_sizes", (1,)),
        prefill_batch_sizes=ints("prefill_batch_sizes", (1,)),
        context_length=integer("context_length"),
        kv_lengths=ints("kv_lengths", ()),
        chunked_prefill=bool(data.get("chunked_prefill", False)),
        mixed_tokens=ints("mixed_tokens", ()),
        max_step_tokens=integer("max_step_tokens"),
        draft_rows=integer("draft_rows"),
    )


def load(cls: type[BucketTable], path: str | Path) -> BucketTable:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise BucketError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise BucketError(f"{path}: expected a JSON object with 'lengths'")
    return from_dict(cls, data)
