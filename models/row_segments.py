"""How a batch of decoding rows of different lengths is split into SDPA calls (the attention ops' fallback where
the native kernels do not take the inputs): runs of consecutive rows, each attended over its longest row."""

from __future__ import annotations

import functools

# How rows are split into SDPA calls, in units of one row-position of a batched call: measured with SmolLM2's
# bf16 layer shapes (one thread), a batch-8 SDPA costs ~0.085 us per row-position, one row alone ~0.06 us per
# position, and every call ~25 us inside this op (slicing, the call itself) = ~300 row-positions.
ROW_CALL_POSITIONS = 300
ROW_POSITION_COST = 0.7  # a lone row's position, relative to a batched one


@functools.lru_cache(maxsize=64)
def segments(extents: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Split rows into runs of consecutive rows, each attended in one SDPA call over its longest row
    (start, stop, positions): the runs minimising the modelled cost. One run for rows of similar length; a
    run per row when they are far apart (7 rows at 150, one at 1000). Cached: the 30 layers of a step ask with
    the same extents."""
    n = len(extents)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for stop in range(1, n + 1):
        longest = 0
        for start in range(stop - 1, -1, -1):
            longest = max(longest, extents[start])
            rows = stop - start
            cost = best[start] + rows * longest * (ROW_POSITION_COST if rows == 1 else 1.0) + ROW_CALL_POSITIONS
            if cost < best[stop]:
                best[stop], cut[stop] = cost, start
    runs = []
    stop = n
    while stop > 0:
        start = cut[stop]
        runs.append((start, stop, max(extents[start:stop])))
        stop = start
    return tuple(reversed(runs))
