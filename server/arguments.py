"""The command line and environment of the server commands: the flags shared by serve, generate and precompile,
and ServerSettings built from them. Every flag here `--some-name` can also be given as the environment variable
`BUCKETSERVE_SOME_NAME` (flags win); the Helm chart maps its values one-to-one onto these variables. `generate`'s
own request flags (server/cli.py) are command-line only.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Iterator, Sequence

from buckets import BucketError, flag_sizes, parse_sizes
from server.config import COMPILE_BACKENDS, DEFAULT_CHUNK, QUANTIZE_MODES, ServerSettings, SettingsError


def env_name(flag: str) -> str:
    """`--max-model-len` -> `BUCKETSERVE_MAX_MODEL_LEN`."""
    return "BUCKETSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by serve, generate and precompile; defaults come from the dataclass."""
    d = ServerSettings()
    parser.add_argument("--model", default=d.model, help="local HF checkpoint dir, hub id, or 'default'")
    parser.add_argument("--served-model-name", default=d.served_model_name)
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--device", default=d.device, choices=["cpu", "cuda", "neuron"])
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CPUs with AVX512-BF16/AMX and on accelerators, else float32")
    parser.add_argument("--compile-backend", default=d.compile_backend, choices=list(COMPILE_BACKENDS))
    parser.add_argument("--inductor-freezing", action="store_true", default=d.inductor_freezing,
                        help="freeze weights into inductor graphs (faster; not reusable from the compile cache)")
    parser.add_argument("--weight-prepack", action=argparse.BooleanOptionalAction, default=d.weight_prepack,
                        help="CPU: run linears on weights prepacked once for oneDNN (default on; float32: steps "
                             "of 2+ rows, one-row steps keep the reference's MKL matmul)")
    parser.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=d.mixed_steps,
                        help="CPU: carry prompt tokens in the decode steps (one pass over the weights for both; "
                             "default on)")
    parser.add_argument("--native-kernels", action=argparse.BooleanOptionalAction, default=d.native_kernels,
                        help="CPU: attention (bfloat16 and float32), linears of 1-128 rows (bfloat16; float32: 1-32) "
                             "and bfloat16 RMSNorms in bucketserve's own kernels, built on first use with the C "
                             "compiler (default on; off: PyTorch's SDPA, oneDNN and inductor's)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                        help="--device cuda: replay each step's graph as CUDA graphs (inductor's cudagraph trees): "
                             "one launch a step instead of one a kernel (default off)")
    parser.add_argument("--quantize", default=d.quantize, choices=list(QUANTIZE_MODES),
                        help="int8: steps of 1-128 rows (decode) read weight-only int8 copies of the linears, per "
                             "output channel (CPU bfloat16 with AMX or AVX512-BF16; prompts of more tokens keep bf16)")
    parser.add_argument("--buckets", type=flag_sizes, default=d.buckets, help="prompt-length buckets, e.g. 64,128,256")
    parser.add_argument("--batch-sizes", type=flag_sizes, default=d.batch_sizes, help="decode batch buckets")
    parser.add_argument("--prefill-batch-sizes", type=flag_sizes, default=d.prefill_batch_sizes)
    parser.add_argument("--kv-buckets", type=flag_sizes, default=d.kv_buckets,
                        help="decode KV-length buckets, ending at the context length (default: the context on the CPU, "
                             "whose attention reads only what each row sees; else powers of two from 256)")
    parser.add_argument("--prefill-chunk-size", type=int, default=d.prefill_chunk_size,
                        help=f"prefill longer prompts in chunks of this many tokens between decode steps (-1: auto, "
                             f"{DEFAULT_CHUNK} with the default buckets; 0: off; with --buckets: off unless set, "
                             f"and then it must equal the largest bucket)")
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--buckets-file", default=d.buckets_file, help="JSON bucket table (from `bucketserve plan`)")
    parser.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests)
    parser.add_argument("--max-waiting-tokens", type=int, default=d.max_waiting_tokens)
    parser.add_argument("--waiting-served-ratio", type=float, default=d.waiting_served_ratio,
                        help="mixed steps: when the prompts that could start number at least this many times "
                             "the decoding rows, a step carries up to the largest token bucket instead of the "
                             "chunk (fewer, bigger prompt steps while many wait; default 1; 0: off, the "
                             "steadiest inter-token latency)")
    parser.add_argument("--max-step-tokens", type=int, default=d.max_step_tokens,
                        help="mixed steps: the most tokens a step carries while rows decode (prompt tokens ride "
                             "with the decoding rows up to it; a decoding row waits about one such step). -1: auto "
                             "(128 where the table allows); 0: the chunk length")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching,
                        help="a finished request's slot keeps its K/V, and a prompt that begins with tokens a slot "
                             "holds (a shared system prompt, a conversation's earlier turns) reuses them instead "
                             "of computing them again (default on; needs mixed steps)")
    parser.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                        help="prompt-lookup (n-gram) speculative decoding: a greedy request carries up to this many "
                             "draft tokens, copied from where its last tokens occurred earlier in its prompt and "
                             "output, into a step that checks them; the output is what greedy decoding gives "
                             "(0: off; needs mixed steps)")
    parser.add_argument("--recompile-policy", default=d.recompile_policy, choices=["error", "allow"])
    parser.add_argument("--batching", default=d.batching, choices=["continuous", "static"],
                        help="static: a batch runs to completion before new requests join (for comparison)")
    parser.add_argument("--compile-cache-dir", default=d.compile_cache_dir,
                        help="persistent compile cache root ('auto': ~/.cache/bucketserve/compile; 'none': off)")
    parser.add_argument("--require-cached-graphs", action="store_true", default=d.require_cached_graphs)
    parser.add_argument("--compile-workers", type=int, default=d.compile_workers,
                        help="processes compiling missing graphs at warm-up, this one included (0: one per core, <= 4)")
    parser.add_argument("--num-threads", type=int, default=d.num_threads)
    parser.add_argument("--api-key", dest="api_keys", action="append", default=None, help="repeatable")
    parser.add_argument("--protect-metrics", action="store_true", default=d.protect_metrics)
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout)
    parser.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    parser.add_argument("--log-format", default=d.log_format, choices=["text", "json"])
    parser.add_argument("--log-prompts", action="store_true", default=d.log_prompts)
    parser.add_argument("--lengths-file", default=d.lengths_file)
    parser.add_argument("--model-cache-dir", default=d.model_cache_dir)
    parser.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                        help="split the model across N ranks (started here; under torchrun, its ranks)")
    parser.add_argument("--tp-timeout", type=float, default=d.tp_timeout,
                        help="seconds a rank may take to join or to answer while serving before the server exits")


_BOOL_FIELDS = {"require_cached_graphs", "protect_metrics", "log_prompts", "inductor_freezing", "weight_prepack",
                "mixed_steps", "native_kernels", "cuda_graphs", "enable_prefix_caching"}
_SIZE_FIELDS = {"buckets", "batch_sizes", "prefill_batch_sizes", "kv_buckets"}


_UNSET = object()  # a default no command line can produce


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """parser.parse_args(argv), plus which dests the command line set itself (`explicit`, read by
    settings_from_args): argparse fills every other dest with its default, so a flag given with its default value
    (`--port 8000`) would look unset and lose to a BUCKETSERVE_* variable. Parsing once more with a marker for
    every default tells them apart."""
    args = parser.parse_args(argv)
    # Accumulating actions (append, count) build on their default: they keep it, and are given when not None.
    actions = [a for p in _parsers(parser) for a in p._actions if a.default is not argparse.SUPPRESS
               and not isinstance(a, (argparse._AppendAction, argparse._CountAction))]
    saved = [a.default for a in actions]
    try:
        for a in actions:
            a.default = _UNSET
        marked = parser.parse_args(argv)
    finally:
        for a, default in zip(actions, saved):
            a.default = default
    args.explicit = frozenset(k for k, v in vars(marked).items() if v is not _UNSET and v is not None)
    return args


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerSettings:
    """Flags given on the command line win; otherwise BUCKETSERVE_* variables; otherwise defaults. Which flags were
    given comes from parse_args; a namespace from plain parse_args counts a flag at its default value as not given."""
    env = os.environ if environ is None else environ
    defaults = ServerSettings()
    explicit: frozenset[str] | None = getattr(args, "explicit", None)
    values: dict[str, Any] = {}
    for name in ServerSettings.__dataclass_fields__:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        default = getattr(defaults, name)
        env_value = env.get(env_name(name if name != "api_keys" else "api_key"))
        if name == "api_keys":
            keys = list(value or [])
            if not keys and env_value is not None:
                keys = [k.strip() for k in env_value.split(",")]  # an empty entry is refused below
            values[name] = tuple(keys)
            continue
        given = name in explicit if explicit is not None else value != default
        if not given and env_value is not None:
            value = _from_env(name, env_value, default)
        values[name] = value
    try:
        return ServerSettings(**values)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from exc


def _from_env(name: str, text: str, default: Any) -> Any:
    try:
        if name in _BOOL_FIELDS:
            return text.strip().lower() in ("1", "true", "yes", "on")
        if name in _SIZE_FIELDS:
            return parse_sizes(text) or default  # "": the default (the Helm chart's empty list)
        if isinstance(default, bool):
            return text.strip().lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        return text
    except (ValueError, BucketError) as exc:
        raise SettingsError(f"{env_name(name)}={text!r}: {exc}") from exc
