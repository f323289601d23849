"""`bucketserve` command line: serve, generate, precompile, plan, bench."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from server.arguments import add_server_arguments, parse_args, settings_from_args
from server.config import SettingsError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bucketserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="load, warm up every graph, and serve the HTTP API")
    add_server_arguments(serve)

    gen = sub.add_parser("generate", help="generate one completion offline through the bucketed graphs",
                         epilog="--prompt, --chat, --max-tokens and the sampling flags are command-line only; "
                                "the other flags also read BUCKETSERVE_* variables.")
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
    from server.commands.verify import add_arguments as add_verify_arguments

    add_verify_arguments(ver)

    plan = sub.add_parser("plan", help="fit length buckets to a traffic sample under a graph budget")
    bench = sub.add_parser("bench", help="benchmark OpenAI-compatible servers with production-like load")
    try:
        from planner import command as plan_command

        plan_command.add_arguments(plan)
    except ImportError:  # pragma: no cover - optional pieces
        pass
    try:
        from bench import cli as bench_cli

        bench_cli.add_arguments(bench)
    except ImportError:  # pragma: no cover
        pass

    args = parse_args(parser, argv)
    from server.commands.logs import configure_logging

    configure_logging(getattr(args, "log_format", "text") or "text")
    try:
        if args.command == "serve":
            from server.commands.serve import serve_main

            return serve_main(settings_from_args(args))
        if args.command == "precompile":
            from server.commands.precompile import precompile_main

            return precompile_main(settings_from_args(args))
        if args.command == "generate":
            from server.commands.generate import generate_main

            return generate_main(settings_from_args(args), args)
        if args.command == "verify":
            from server.commands.verify import verify_main

            return verify_main(settings_from_args(args), args)
        if args.command == "plan":
            from planner import command as plan_command

            if args.model:  # the tokenizer of --prompts-file: "default" and local paths as serve reads them
                from models.loading import resolve_model_path

                args.model = resolve_model_path(args.model)
            return plan_command.run(args)
        if args.command == "bench":
            from bench import cli as bench_cli

            return bench_cli.run(args)
    except SettingsError as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not _input_error(exc):
            raise
        print(f"bucketserve {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 2


# What an operator's input can cause (a model path that is not a model, a missing file, an empty prompt, a server
# that is down): one line, not a traceback. By module and name, so that the check imports nothing: an instance
# of one of these means its module is loaded.
_INPUT_ERRORS = (("models.loading", "ModelLoadError"), ("buckets.errors", "BucketError"),
                 ("models.params", "SamplingError"), ("planner.inputs", "PlanInputError"),
                 ("httpx", "TransportError"))


def _input_error(exc: Exception) -> bool:
    if isinstance(exc, OSError):  # FileNotFoundError, IsADirectoryError, PermissionError, ConnectionError...
        return True
    return any(module in sys.modules and isinstance(exc, getattr(sys.modules[module], name))
               for module, name in _INPUT_ERRORS)


if __name__ == "__main__":
    sys.exit(main())
