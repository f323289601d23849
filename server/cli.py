"""`bucketserve` command line: serve, generate, precompile, plan, bench."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Sequence

from server.config import ServerSettings, SettingsError, add_server_arguments, settings_from_args

if TYPE_CHECKING:
    from models.mesh import MeshSpec


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bucketserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="load, warm up every graph, and serve the HTTP API")
    add_server_arguments(serve)

    gen = sub.add_parser("generate", help="generate one completion offline through the bucketed graphs")
    add_server_arguments(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="render the prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)

    pre = sub.add_parser("precompile", help="warm every graph into the compile cache and exit")
    add_server_arguments(pre)

    ver = sub.add_parser("verify", help="compare the serving path (or --against a server) with the float32 "
                                        "reference on every bucket; non-zero exit on a mismatch")
    add_server_arguments(ver)
    from server.verify import add_arguments as add_verify_arguments

    add_verify_arguments(ver)

    plan = sub.add_parser("plan", help="fit length buckets to a traffic sample under a graph budget")
    bench = sub.add_parser("bench", help="benchmark OpenAI-compatible servers with production-like load")
    try:
        from server import plan_command

        plan_command.add_arguments(plan)
    except ImportError:  # pragma: no cover - optional pieces
        pass
    try:
        from bench import cli as bench_cli

        bench_cli.add_arguments(bench)
    except ImportError:  # pragma: no cover
        pass

    args = parser.parse_args(argv)
    from server.logs import configure_logging

    configure_logging(getattr(args, "log_format", "text") or "text")
    try:
        if args.command == "serve":
            from server.serve import serve_main

            return serve_main(settings_from_args(args))
        if args.command == "precompile":
            from server.precompile import precompile_main

            return precompile_main(settings_from_args(args))
        if args.command == "generate":
            return _generate(args)
        if args.command == "verify":
            from server.verify import verify_main

            return verify_main(settings_from_args(args), args)
        if args.command == "plan":
            from server import plan_command

            return plan_command.run(args)
        if args.command == "bench":
            from bench import cli as bench_cli

            return bench_cli.run(args)
    except SettingsError as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _generate(args: argparse.Namespace) -> int:
    from server.tp_launch import run_ranked  # tensor parallel: rank 0 generates, the other ranks follow

    settings = settings_from_args(args)
    return run_ranked(settings, lambda spec, launch: _generate_lead(args, settings, spec))


def _generate_lead(args: argparse.Namespace, settings: ServerSettings, mesh_spec: MeshSpec | None) -> int:
    from buckets import PromptTooLongError
    from models.generator import generate_one
    from models.loading import resolve_model_path
    from models.sampling import SamplingError, SamplingParams
    from server.engine_model import EngineModel

    path = resolve_model_path(settings.model, settings.model_cache_dir or None)
    model = EngineModel(settings, path, mesh_spec=mesh_spec)
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
    from buckets import GraphKey

    # One request needs its prefill bucket and the smallest decode batch at the KV buckets it will reach.
    table = model.table
    last_kv = table.kv_for(len(ids) + params.max_tokens)
    decode_keys = [GraphKey("decode", table.batch_sizes[0], kv) for kv in table.kv_lengths if kv <= last_kv]
    # A prompt past the largest length bucket is prefilled in chunks: its first chunk, then chunk graphs.
    chunked = bucket > table.max_length
    chunk_keys = [GraphKey("chunk", 1, kv) for kv in table.chunk_kv_lengths if kv <= last_kv] if chunked else []
    prefill_key = GraphKey("prefill", table.prefill_batch_sizes[0], min(bucket, table.max_length))
    model.load_and_warm([*decode_keys, *chunk_keys, prefill_key])
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


if __name__ == "__main__":
    sys.exit(main())
