"""Compile accounting: every graph compiled with a persistent cache configured is a hit or a miss."""

from __future__ import annotations

from typing import Any

import torch

from models.compile import CompileAccountant


def _backend_that_loads_nothing(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    return gm.forward  # like inductor with freezing: compiled, no cache counter moves


def test_a_compile_that_bypasses_the_cache_is_a_miss_not_unknown() -> None:
    seen = []
    with_cache = CompileAccountant(on_compile=seen.append, cache_enabled=True)
    without = CompileAccountant()
    for accountant in (with_cache, without):
        fn = torch.compile(lambda x: x * 2 + 1, backend=accountant.wrap(_backend_that_loads_nothing), dynamic=False)
        fn(torch.ones(3))
    assert [r.cache_hit for r in with_cache.records] == [False] and seen[0].cache_hit is False
    assert [r.cache_hit for r in without.records] == [None]  # no cache configured: nothing to say
