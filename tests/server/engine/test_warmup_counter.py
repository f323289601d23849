"""/ready's `seconds` never steps back when warm-up begins after the model load."""

from __future__ import annotations

import pytest

from server.engine import warmup_counter
from server.engine.warmup_counter import WarmupCounter


def test_elapsed_covers_the_load_and_never_steps_back_when_warm_up_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(warmup_counter.time, "monotonic", lambda: clock[0])
    counter = WarmupCounter(total=4, created=100.0, started=100.0)  # the engine begins: the model loads
    clock[0] = 130.0  # 30 s of model load
    before = counter.elapsed
    counter.started = clock[0]  # warm-up begins (as ServedModel.load_and_warm sets it)
    clock[0] = 131.0
    assert before == 30.0 and counter.elapsed == 31.0  # was 1.0: `seconds` restarts with the warm-up
    assert counter.seconds == 1.0
    counter.done = 1
    assert counter.eta() == 3.0  # the pace of warm-up alone: 1 s a graph, 3 to go
    counter.finished = 135.0
    clock[0] = 500.0
    assert counter.elapsed == 35.0 and counter.seconds == 5.0  # frozen at the end of warm-up
