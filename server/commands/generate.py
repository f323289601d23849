"""`bucketserve generate`: one completion offline through the bucketed graphs (no HTTP, no engine thread),
warming only the graphs this one request needs."""

from __future__ import annotations

import argparse
import sys
import time

from buckets import GraphKey, PromptTooLongError
from models.generator import generate_one, solo_pieces
from models.mesh import MeshSpec
from models.sampling import SamplingError, SamplingParams
from server.compose import build_model
from server.config import ServerSettings


def generate_main(settings: ServerSettings, args: argparse.Namespace) -> int:
    from server.commands.tp_launch import run_ranked  # tensor parallel: rank 0 generates, the other ranks follow

    return run_ranked(settings, lambda spec, launch: _generate_lead(args, settings, spec))


def _generate_lead(args: argparse.Namespace, settings: ServerSettings, mesh_spec: MeshSpec | None) -> int:
    model = build_model(settings, mesh_spec=mesh_spec)
    tok = model.tokenizer
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    else:
        ids = tok.encode(args.prompt)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
        bucket = model.table.check_request(len(ids), params.max_tokens)
    except (SamplingError, PromptTooLongError) as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        model.close()
        return 2
    t0 = time.monotonic()

    # One request needs its prefill bucket and the smallest decode batch at the KV buckets it will reach.
    table = model.table
    last_kv = table.kv_for(len(ids) + params.max_tokens)
    decode_keys = [GraphKey("decode", table.batch_sizes[0], kv) for kv in table.kv_lengths if kv <= last_kv]
    # A prompt past the largest length bucket is prefilled in pieces (solo_pieces: as the scheduler runs it): mixed
    # steps of the solo budget from its start, or its first chunk then mixed steps or chunk graphs.
    first, piece = solo_pieces(table, len(ids), bucket)
    chunked = bucket > table.max_length
    chunk_keys = [GraphKey("chunk", 1, kv) for kv in table.chunk_kv_lengths if kv <= last_kv] if chunked else []
    if chunked and table.mixed_tokens:
        chunk_keys = sorted({GraphKey("mixed", table.max_batch, table.mixed_for(min(piece, len(ids) - o)))
                             for o in range(first, len(ids), piece)})
    prefill_keys = [GraphKey("prefill", table.prefill_batch_sizes[0], first)] if first else []
    model.load_and_warm([*decode_keys, *chunk_keys, *prefill_keys])
    warm = time.monotonic() - t0
    assert model.runner is not None
    result = generate_one(model.runner, ids, params, bucket, model.eos_token_ids)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    print(text)
    decode = result.decode_seconds
    tps = len(decode) / sum(decode) if decode else 0.0
    print(
        f"\n[bucket {bucket} (prompt {len(ids)} tokens, {bucket - len(ids)} padding) | "
        f"warm-up {warm:.1f} s for {model.runner.num_graphs} graphs, "
        f"{model.accountant.count('warmup')} compiled, {model.accountant.count('serving')} after warm-up | "
        f"prefill {result.prefill_seconds * 1000:.1f} ms | decode {len(decode)} steps, "
        f"{(sum(decode) / len(decode) * 1000) if decode else 0:.1f} ms/token, {tps:.1f} tokens/s | "
        f"finish {result.finish_reason}]",
        file=sys.stderr,
    )
    model.close()
    return 0
