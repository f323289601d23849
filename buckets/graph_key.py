"""The identity of one compiled graph (phase, rows, length) and its bounded metric label."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode", "chunk", "sample", "mixed", "verify"]


@dataclass(frozen=True, order=True)
class GraphKey:
    """Identifies one compiled graph: prefill graphs by (rows, length bucket), decode graphs by
    (rows, KV-length bucket): a decode graph attends over the first `length` positions of each slot;
    chunk graphs (one row, one chunk of the chunk length) by the KV-length bucket they attend over;
    sampling graphs by the rows of logits they sample (every decode and prefill batch bucket); mixed graphs by
    (rows of logits = the largest batch bucket, token bucket); verify graphs, mixed graphs that also return the
    logits at the draft tokens of speculative decoding, by (rows of logits = the table's verify_rows, token
    bucket)."""

    phase: Phase
    batch: int
    length: int

    @property
    def bucket(self) -> str:
        """Bounded metric label for the bucket this graph serves."""
        if self.phase == "decode":
            return f"b{self.batch}_kv{self.length}"
        if self.phase == "chunk":
            return f"kv{self.length}"
        if self.phase == "sample":
            return f"b{self.batch}"
        if self.phase in ("mixed", "verify"):
            return f"t{self.length}"
        return f"b{self.batch}_l{self.length}"

    def __str__(self) -> str:
        return f"{self.phase}[{self.bucket}]"
