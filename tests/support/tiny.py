"""Test helpers: tiny random-weight checkpoints and engines built from them (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from buckets import BucketTable
from buckets.defaults import default_mixed_tokens
from server.compose import build_model, engine_for
from server.config import ServerSettings
from server.engine.engine import Engine

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_checkpoint(path: str | Path, *, arch: str = "llama", vocab_words: int = 400, seed: int = 0) -> str:
    """Save a tiny random Llama (or Qwen2 / GPT-2) plus a word-level tokenizer with a chat template.
    initializer_range=0.1 makes the logits peaked enough that greedy equality tests mean something."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    out = Path(path)
    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<eos>"]
    words = [f"w{i}" for i in range(vocab_words)] + ["the", "cat", "sat", "on", "mat", "hello", "world",
                                                     "user", "assistant", "system", "a", "b", "c", "x", "y"]
    vocab = {tok: i for i, tok in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<eos>", "<pad>", "<unk>"])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    common: dict[str, Any] = dict(vocab_size=len(vocab), initializer_range=0.1, eos_token_id=vocab["<eos>"],
                                  pad_token_id=vocab["<pad>"], bos_token_id=None)
    if arch == "gpt2":
        config: Any = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    elif arch == "qwen2":
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    else:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=512, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return str(out)


TINY_TABLE = BucketTable(lengths=(8, 16, 32, 64), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2),
                         context_length=128, kv_lengths=(32, 128))
# What a server with tiny_settings() builds: the CPU default adds mixed steps over the length buckets.
_MIXED = replace(TINY_TABLE, mixed_tokens=default_mixed_tokens(TINY_TABLE))
TINY_SERVED_TABLE = replace(_MIXED, draft_rows=ServerSettings().draft_rows(_MIXED))  # and speculative decoding's


def tiny_settings(**overrides: Any) -> ServerSettings:
    base = ServerSettings(compile_backend="eager", dtype="float32", buckets=TINY_TABLE.lengths,
                          batch_sizes=TINY_TABLE.batch_sizes,
                          prefill_batch_sizes=TINY_TABLE.prefill_batch_sizes, kv_buckets=TINY_TABLE.kv_lengths,
                          max_model_len=TINY_TABLE.context_length, num_threads=1, compile_cache_dir="none")
    return replace(base, **overrides)


def tiny_engine(tmp_path: str | Path, *, metrics: Any = None, settings: ServerSettings | None = None,
                table: BucketTable | None = None) -> Engine:
    """An unstarted Engine over a tiny random Llama saved under tmp_path (eager backend by default)."""
    path = build_tiny_checkpoint(Path(tmp_path) / "tiny-llama")
    s = settings or tiny_settings()
    return engine_for(s, build_model(s, path, table=table, hooks=metrics), metrics)
