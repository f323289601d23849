"""Start-up checks of a tensor-parallel model: divisibility by the TP size, a whole checkpoint, a plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig

from models.mesh import MeshError
from models.sharding import check_checkpoint_whole, check_shardable, shard_layout
from tests.support.tiny import build_tiny_checkpoint


def _llama(**kw: int) -> LlamaConfig:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64)
    return LlamaConfig(**{**base, **kw})


def test_layout_reads_the_models_own_plan_and_full_shapes() -> None:
    layout = shard_layout(_llama())
    assert layout.style_of("model.layers.0.self_attn.q_proj.weight") == "colwise"
    assert layout.expected("model.layers.0.self_attn.o_proj.weight") == ("shard", 1)
    assert layout.expected("model.norm.weight") is None
    assert layout.shapes["model.layers.0.self_attn.k_proj.weight"] == (32, 64)


@pytest.mark.parametrize("config, tp, message", [
    (_llama(), 4, "num_key_value_heads 2 is not divisible by the tensor-parallel size 4"),
    (_llama(num_attention_heads=8, num_key_value_heads=8, hidden_size=48), 3,
     "num_attention_heads 8 is not divisible by the tensor-parallel size 3"),
    (_llama(vocab_size=63), 2, "model.embed_tokens.weight dimension 0 (63, style embedding_rowwise) is not divisible"),
    (_llama(intermediate_size=130), 4, "model.layers.0.mlp.gate_proj.weight dimension 0 (130, style colwise)"),
])
def test_sizes_not_divisible_by_tp_are_refused_with_the_numbers(config: LlamaConfig, tp: int, message: str) -> None:
    with pytest.raises(MeshError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_shardable(config, shard_layout(config), tp)


def test_divisible_model_passes() -> None:
    config = _llama()
    check_shardable(config, shard_layout(config), 2)


def test_a_model_without_a_tp_plan_is_refused(tiny_models: dict[str, str]) -> None:
    with pytest.raises(MeshError, match="GPT2LMHeadModel has no tensor-parallel plan"):
        shard_layout(AutoConfig.from_pretrained(tiny_models["gpt2"]))


def test_an_already_sharded_checkpoint_is_refused(tmp_path: Path) -> None:
    path = Path(build_tiny_checkpoint(tmp_path / "tiny"))
    layout = shard_layout(AutoConfig.from_pretrained(path))
    check_checkpoint_whole(str(path), layout)  # the whole checkpoint passes
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:32].clone()  # what rank 0 of a TP=2 model holds
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(MeshError, match=rf"{name} in model.safetensors has shape \[32, 64\] but the model needs "
                                        r"\[64, 64\]: the checkpoint is already sharded"):
        check_checkpoint_whole(str(path), layout)


def test_slot_cache_holds_the_local_kv_heads() -> None:
    import torch

    from models.slot_cache import SlotStorage

    def storage(tp: int) -> SlotStorage:
        return SlotStorage(_llama(), max_slots=2, context_length=8, max_prefill_rows=1, max_prefill_length=8,
                           dtype=torch.float32, device="cpu", tp_size=tp)

    assert storage(1).keys[0].shape == (2, 2, 8, 16)  # [slots, KV heads, context, head dim]
    assert storage(2).keys[0].shape == (2, 1, 8, 16)  # one of the two KV heads per rank
    with pytest.raises(ValueError, match="2 KV heads do not divide by the tensor-parallel size 4"):
        storage(4)
