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


def test_cuda_graphs_set_inductors_switch_and_each_model_step_marks_a_new_step(monkeypatch: Any) -> None:
    """--cuda-graphs turns on inductor's CUDA graphs (cudagraph trees) and, before each model graph (not the
    sampling graph, which reads that step's logits), tells them a new step begins; off, neither."""
    import torch._inductor.config as inductor_config

    from buckets import GraphKey
    from models.compile import CompileSettings, configure_compiler
    from models.graph_set import GraphSet

    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    fns = {"decode": lambda model, x: x + 1, "sample": lambda model, x: x * 2}
    # the config's own patch, not monkeypatch: pytest 9.2 reads a proxy attribute's old value from its (empty)
    # __dict__ and so deletes the switch on undo, which hides it from every later reader (the profiler, dynamo)
    with inductor_config.patch({"triton.cudagraphs": False}):
        for on in (False, True):
            settings = CompileSettings(backend="inductor", cuda_graphs=on)
            configure_compiler(settings, 2)
            assert inductor_config.triton.cudagraphs is on
            graphs = GraphSet(torch.nn.Linear(2, 2), CompileSettings(backend="eager", cuda_graphs=on),
                              CompileAccountant(), 2, fns)
            marks.clear()
            graphs.call(GraphKey("decode", 1, 8), (torch.ones(2),), fail_closed=False, skip_loaded=False)
            graphs.call(GraphKey("sample", 1, 0), (torch.ones(2),), fail_closed=False, skip_loaded=False)
            assert marks == ([1] if on else [])
    assert inductor_config.triton.cudagraphs is False
