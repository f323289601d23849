"""A random-weight model of SmolLM2-135M's size that tensor parallelism can split in two, for the layout bench.

SmolLM2-135M itself has 9 attention heads and 3 KV heads: not divisible by 2, so `--tensor-parallel-size 2`
refuses it. This keeps its width (576), depth (30 layers), MLP (1536), vocabulary (49152, tied) and tokenizer,
with 8 heads of 72 and 4 KV heads. Random weights: the text is noise, the speed is the point (the bench uses
ignore_eos, so every request generates exactly its max_tokens). Usage:
    python scripts/tp_bench_model.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(out: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.loading import ensure_default_model

    source = ensure_default_model()
    target = Path(out)
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 72
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, target / name)
    print(f"{target}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, heads 8/4 (KV)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
