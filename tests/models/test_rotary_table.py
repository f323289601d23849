"""Rotary position tables (models/rotary_table.py): the lookup returns what the replaced module computed, the
step graphs use it, and modules whose frequencies follow the sequence keep their own forward."""

from __future__ import annotations

import pytest
import torch

from buckets import BucketTable, GraphKey
from models.compile import CompileSettings
from models.loading import load_model
from models.rotary_table import RotaryTable, tabulate_rotary
from models.runner import ModelRunner


def _rotaries(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("rotary_emb")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_table_returns_the_modules_own_output(tiny_models: dict[str, str], arch: str, dtype: str) -> None:
    model = load_model(tiny_models[arch], dtype, "cpu")
    (original,) = _rotaries(model)
    x = torch.empty(0, dtype=model.dtype)
    ids = torch.tensor([[0, 5, 63, 17], [3, 3, 40, 1]])  # [B, T], any order, repeats
    with torch.no_grad():
        want = original(x, ids)
        assert tabulate_rotary(model, 64, model.dtype) == 1
        (table,) = _rotaries(model)
        got = table(x, ids)
    assert isinstance(table, RotaryTable) and table is not original
    assert table.cos.shape == (64, want[0].shape[-1]) and table.cos.dtype == model.dtype
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape == (2, 4, w.shape[-1]) and g.dtype == w.dtype
        assert torch.equal(g, w)
    assert tabulate_rotary(model, 64, model.dtype) == 0  # nothing left to replace


def test_dynamic_rope_keeps_its_forward(tiny_llama: str) -> None:
    model = load_model(tiny_llama, "float32", "cpu")
    (rotary,) = _rotaries(model)
    rotary.rope_type = "dynamic"  # frequencies recomputed from the longest position seen: no fixed table
    assert tabulate_rotary(model, 64, torch.float32) == 0
    assert _rotaries(model)[0] is rotary
    with pytest.raises(ValueError):
        tabulate_rotary(model, 0, torch.float32)


def test_runner_steps_look_the_table_up_and_match_eager(tiny_llama: str) -> None:
    """A compiled decode step of the runner (which tabulates) gives the logits of the untouched eager model."""
    reference = load_model(tiny_llama, "float32", "cpu")
    model = load_model(tiny_llama, "float32", "cpu")
    table = BucketTable(lengths=(8,), batch_sizes=(1,), prefill_batch_sizes=(1,), context_length=32,
                        kv_lengths=(32,))
    runner = ModelRunner(model, table, CompileSettings(backend="inductor"))
    assert runner.rotary_tables == 1 and isinstance(_rotaries(model)[0], RotaryTable)
    runner.warmup([GraphKey("prefill", 1, 8), GraphKey("decode", 1, 32)])
    from models.runner import PrefillRow

    prompt = [7, 9, 11, 13, 15]
    first = runner.prefill([PrefillRow(0, prompt)], 8, 1)
    nxt = int(first[0].argmax())
    step = runner.decode(1, torch.tensor([nxt]), torch.tensor([len(prompt)]))
    with torch.no_grad():
        want = reference(torch.tensor([prompt + [nxt]])).logits[0]
    torch.testing.assert_close(first[0], want[len(prompt) - 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[0], want[len(prompt)], rtol=1e-4, atol=1e-4)
