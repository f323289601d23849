"""The Neuron plumbing, run through the same code path with a stand-in for TorchNeuron's backend.

torch-neuronx cannot be installed here, so a fake `torch_neuronx` module registers a backend named
"neuron" that records what it is asked to compile and runs the graph eagerly. The runner must reach it
through `torch.compile(backend=..., fullgraph=True, dynamic=False)` and point the NEFF cache at the
configured directory."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from buckets import BucketTable
from models.compile import CompileSettings, configure_compiler
from models.generator import generate_one
from models.loading import load_model
from models.runner import ModelRunner
from models.sampling import SamplingParams


@pytest.fixture
def fake_torch_neuronx(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from torch._dynamo import lookup_backend
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    graphs: list[int] = []

    def neuron_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        # A static-shape compiler: every example input must have concrete sizes.
        assert all(not isinstance(d, torch.SymInt) for t in example_inputs if isinstance(t, torch.Tensor)
                   for d in t.shape), "dynamic shapes reached the neuron backend"
        graphs.append(len(gm.graph.nodes))
        # Like TorchNeuron's NEFF cache: a graph seen before is loaded, a new one is written to the cache.
        cache = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR")
        if cache:
            neff = os.path.join(cache, f"{hash(gm.code)}.neff")
            os.makedirs(cache, exist_ok=True)
            if not os.path.exists(neff):
                open(neff, "w").close()
        return lookup_backend("eager")(gm, example_inputs)

    module = types.ModuleType("torch_neuronx")
    monkeypatch.setitem(sys.modules, "torch_neuronx", module)
    monkeypatch.delitem(_COMPILER_FNS, "neuron", raising=False)
    register_backend(neuron_backend, name="neuron")
    yield graphs
    _COMPILER_FNS.pop("neuron", None)


def test_neuron_backend_compiles_every_bucket_once(tiny_llama: str, fake_torch_neuronx: list[int],
                                                   tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NEURONX_NEFF_CACHE_DIR", raising=False)
    table = BucketTable(lengths=(8, 16), batch_sizes=(1, 2), prefill_batch_sizes=(1,), context_length=32)
    settings = CompileSettings(backend="neuron", cache_dir=str(tmp_path / "neff"))
    model = load_model(tiny_llama, "float32", "cpu")
    runner = ModelRunner(model, table, settings)
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "neff")
    runner.warmup()
    assert len(fake_torch_neuronx) == table.num_graphs == runner.accountant.count("warmup")
    result = generate_one(runner, [5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 8)
    assert len(result.token_ids) == 5
    assert runner.accountant.count("serving") == 0 and len(fake_torch_neuronx) == table.num_graphs
    # Every graph wrote a NEFF: misses. A second runner (as after a restart) finds them all: hits.
    assert [r.cache_hit for r in runner.accountant.records] == [False] * table.num_graphs
    again = ModelRunner(model, table, settings)
    again.warmup()
    assert [r.cache_hit for r in again.accountant.records] == [True] * table.num_graphs


def test_neuron_backend_without_torch_neuronx_is_a_clear_error(tiny_llama: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import fails
    table = BucketTable(lengths=(8,), context_length=8)
    with pytest.raises(RuntimeError, match="torch-neuronx"):
        ModelRunner(load_model(tiny_llama, "float32", "cpu"), table, CompileSettings(backend="neuron"))


def test_compiler_configuration_raises_recompile_limit() -> None:
    import torch._dynamo.config as dc

    configure_compiler(CompileSettings(backend="dynamo-eager"), num_graphs=40)
    assert dc.recompile_limit >= 40 and dc.automatic_dynamic_shapes is False


def test_inductor_rounds_like_eager_in_reduced_precision() -> None:
    """Without emulated precision casts, bfloat16 graphs flipped near-tie argmaxes against eager bfloat16
    (the default model's answer to "What is the capital of France?" began with "L" instead of "The")."""
    import torch._inductor.config as ic

    configure_compiler(CompileSettings(backend="inductor"), num_graphs=4)
    assert ic.emulate_precision_casts is True
