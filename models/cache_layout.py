"""What a transformers config says about a model's KV cache: its geometry and the kind of each layer's
attention, and whether the per-slot cache (models/slot_cache.py) supports it."""

from __future__ import annotations

from typing import Any

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model's cache layout (recurrent, chunked, shared-KV layers...) is not supported."""


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    num_kv = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, num_kv, head_dim


def layer_types(config: Any) -> list[str]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    if types is None:
        sliding = getattr(text, "sliding_window", None)
        use_sliding = getattr(text, "use_sliding_window", True)
        kind = "sliding_attention" if sliding and use_sliding else "full_attention"
        types = [kind] * num_layers
    for t in types:
        if t not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(f"layer type {t!r} is not supported (supported: {SUPPORTED_LAYER_TYPES})")
    return list(types)


def full_attention_only(config: Any) -> bool:
    """Every layer attends over the whole past (no sliding windows), and the cache supports the model."""
    try:
        return all(kind == "full_attention" for kind in layer_types(config))
    except UnsupportedModelError:
        return False  # the runner says why when it is built
