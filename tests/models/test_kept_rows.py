"""The last layer's MLP on the kept rows (models/kept_rows.py): the kept rows' logits are the unswapped model's, bit
for bit; the others reach the MLP as zeros (which the C++ linears skip); only Llama-shaped layers are swapped."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.kept_rows import LAYER_TYPES, kept_rows, swap_last_layer


def _body(cls: type) -> str:
    source = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    return source[source.index("residual = hidden_states"):]


def test_the_swapped_layer_types_run_llamas_forward() -> None:
    """The swap re-implements LlamaDecoderLayer.forward: a transformers release that changes any listed layer's
    forward fails here, not in served output."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    for name in LAYER_TYPES:
        module = importlib.import_module(f"transformers.models.{name[: -len('DecoderLayer')].lower()}.modeling_"
                                         f"{name[: -len('DecoderLayer')].lower()}")
        assert _body(getattr(module, name)) == _body(LlamaDecoderLayer), name


def test_kept_rows_marks_the_kept_indices() -> None:
    got = kept_rows(5, torch.tensor([3, 0]))
    assert got.shape == (1, 5, 1) and got.dtype == torch.bool
    assert got.view(-1).tolist() == [True, False, False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_give_the_same_logits_and_zero_mlp_rows(tiny_llama: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=dtype).eval()
    ids = torch.randint(5, 200, (1, 11))
    keep = torch.tensor([2, 7, 10])
    with torch.no_grad():
        want = model(input_ids=ids, logits_to_keep=keep).logits
        assert swap_last_layer(model)
        seen: list[torch.Tensor] = []
        hook = model.model.layers[-1].mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
        got = model(input_ids=ids, logits_to_keep=keep, kept_rows=kept_rows(11, keep)).logits
        plain = model(input_ids=ids, logits_to_keep=keep).logits  # without kept_rows: as before
        hook.remove()
    assert torch.equal(got, want) and torch.equal(plain, want)
    rows = seen[0][0].abs().sum(-1)  # [T]: the first call's MLP input
    assert (rows[keep] > 0).all()
    assert (rows[[i for i in range(11) if i not in keep.tolist()]] == 0).all()
    assert (seen[1][0].abs().sum(-1) > 0).all()  # no kept_rows: every row


def test_only_llama_shaped_layers_are_swapped(tiny_models: dict[str, str]) -> None:
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])
    assert not swap_last_layer(gpt2)
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"])
    assert swap_last_layer(qwen2) and swap_last_layer(qwen2)  # again: already swapped
    assert type(qwen2.model.layers[-1]).__name__ == "KeptRowsQwen2DecoderLayer"
    assert type(qwen2.model.layers[0]).__name__ == "Qwen2DecoderLayer"  # the last layer only
