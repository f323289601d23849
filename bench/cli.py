"""`bucketserve bench`: command-line options and the top-level flow (wired by server/cli.py).

Against a running server: `--url http://127.0.0.1:8000`. Against servers it starts itself, one after
another: `--compare bucketserve,transformers[,llama]`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from bench import modelfiles
from bench.compare import Comparison, output_bound, parse_names, run_compare
from bench.plots import write_plots
from bench.prompts import (
    CachingTokenizer,
    LocalTokenizer,
    Prompt,
    Tokenizer,
    TokenizerError,
    build_prompts,
    load_corpus,
    probe_server_tokenizer,
)
from bench.report import document, ratio_lines, write_json, write_markdown
from bench.runner import RunOptions, TargetRun, failed_target, run_target
from bench.servers import ServerError, wait_until_ready
from bench.workload import RequestPlan, WorkloadError, WorkloadSpec, parse_length_dist, plan_requests, read_prompts_file

DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", default="", help=f"a running OpenAI-compatible server (default {DEFAULT_URL})")
    g.add_argument("--compare", default="", help="start these servers in turn: bucketserve,transformers,llama")
    g.add_argument("--interleave", action="store_true",
                   help="with --compare: start every server first, then run each level and TTFT probe on every "
                        "server in turn, so drift in the machine's speed moves all engines' figures alike")
    g.add_argument("--model", default=modelfiles.DEFAULT_MODEL, help="weights for --compare (dir, .gguf or 'default')")
    g.add_argument("--hf-model", default="", help="HF checkpoint for transformers (default: from --model)")
    g.add_argument("--llama-server", default="", help="llama.cpp llama-server binary (llama is skipped without)")
    g.add_argument("--llama-model", default="", help="GGUF for llama-server (default: from --model)")
    g.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads per server (0: their default)")
    for name in ("bucketserve", "transformers", "llama", "vllm"):
        g.add_argument(f"--{name}-args", default="", help=f"extra command-line arguments for {name}")
    g.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="Python of the vLLM CPU environment (`make vllm-venv`); vllm is skipped without it")
    g.add_argument("--vllm-max-model-len", type=int, default=2048, help="vLLM --max-model-len (our context)")
    g.add_argument("--dtype", default="", help="same dtype for bucketserve and vllm (float32 | bfloat16 | auto)")
    g.add_argument("--max-num-seqs", type=int, default=0,
                   help="concurrent sequences for every engine: vLLM --max-num-seqs, bucketserve's largest batch "
                        "bucket (0: bucketserve's default; vLLM then gets the largest concurrency level)")
    g.add_argument("--ready-timeout", type=float, default=1800.0,
                   help="seconds to wait for a server to be ready (started, or warming at --url)")
    g.add_argument("--model-cache-dir", default="", help="where converted checkpoints go (~/.cache/bucketserve/bench)")
    g.add_argument("--api-key", default="", help="sent as Authorization: Bearer KEY")
    g.add_argument("--served-model", default="", help="`model` field (default: first id of /v1/models)")
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-len", default="lognormal:median=128,sigma=0.6",
                   help="fixed:N | uniform:LO..HI | lognormal:median=M,sigma=S (tokens)")
    w.add_argument("--output-len", default="fixed:64", help="same forms as --prompt-len (max_tokens)")
    w.add_argument("--prompts-file", default="", help="JSONL prompts instead of corpus text")
    w.add_argument("--max-prompt-len", type=int, default=1024, help="prompt lengths are capped here")
    w.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level")
    w.add_argument("--concurrency", default="1,4,16", help="closed-loop client counts, e.g. 1,4,16")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--tokenizer", default="", help="local tokenizer dir (or .gguf) when the server has no /tokenize")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (falls back when the server refuses)")
    w.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--warmup-requests", type=int, default=1, help="untimed requests before the levels (>= 1)")
    w.add_argument("--request-timeout", type=float, default=600.0)
    w.add_argument("--max-seconds-per-level", type=float, default=0.0, help="stop issuing after this (0: none)")
    w.add_argument("--rounds", type=int, default=1,
                   help="run every level this many times (with --interleave: all levels, then all again); a "
                        "level's figures pool its rounds, and the report gives each round's output tok/s")
    w.add_argument("--ttft-probe", default="", help="prompt lengths, e.g. 32,128,512,1024: after the levels, "
                   "TTFT of single requests at exactly these lengths (median of --ttft-probe-repeats)")
    w.add_argument("--ttft-probe-repeats", type=int, default=3)
    o = p.add_argument_group("output")
    o.add_argument("--out", default="", help="output dir (default results/bench-<timestamp>)")
    o.add_argument("--no-plots", action="store_true")


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise WorkloadError(f"--concurrency must be a comma list of integers, got {text!r}") from exc
    if not levels or any(c < 1 for c in levels):
        raise WorkloadError(f"--concurrency needs positive integers, got {text!r}")
    return levels


def _tokenizer(url: str, args: argparse.Namespace, headers: dict[str, str], local: str | None) -> Tokenizer:
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    remote = probe_server_tokenizer(url, headers)
    if remote is not None:
        return remote
    if local:
        return LocalTokenizer(local)
    try:  # a server that is down has no /tokenize either: say which it is
        httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.TransportError as exc:
        raise TokenizerError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    raise TokenizerError(f"{url} has no /tokenize endpoint: give --tokenizer DIR")


class PromptMaker:
    """Builds the workload's prompts once, with the first reachable tokenizer."""

    def __init__(self, args: argparse.Namespace, spec: WorkloadSpec, headers: dict[str, str]) -> None:
        self.args, self.spec, self.headers = args, spec, headers
        self.tokenizer_name = ""

    def __call__(self, url: str, local: str | None) -> tuple[list[Prompt], list[Prompt]]:
        tok = CachingTokenizer(_tokenizer(url, self.args, self.headers, local))
        self.tokenizer_name = tok.name
        corpus = load_corpus()
        file_prompts = read_prompts_file(self.spec.prompts_file) if self.spec.prompts_file else None
        plans = plan_requests(self.spec, len(corpus), file_prompts)
        prompts = build_prompts(plans, tok, corpus, file_prompts, self.spec.max_prompt_len)
        # TTFT probes: exact lengths, a few output tokens (TTFT is the first one), a distinct text for every
        # repeat (a server with a prefix cache must not turn repeats into hits).
        repeats = max(1, int(getattr(self.args, "ttft_probe_repeats", 3)))
        probe_plans = [RequestPlan(-1 - i, n, 4, len(corpus) // 2 + 997 * i)
                       for i, n in enumerate(n for n in self.probe_lengths for _ in range(repeats))]
        probes = build_prompts(probe_plans, tok, corpus)
        print(f"[bench] built {len(prompts)} prompts with {tok.name} ({tok.calls} tokenize calls)")
        return prompts, probes

    @property
    def probe_lengths(self) -> tuple[int, ...]:
        text = str(getattr(self.args, "ttft_probe", "") or "")
        return tuple(int(x) for x in text.split(",") if x.strip())


def run(args: argparse.Namespace) -> int:
    # httpx logs every request at INFO; the exact-length search alone makes hundreds of them
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        levels = _concurrency(args.concurrency)
        spec = WorkloadSpec(
            prompt_len=parse_length_dist(args.prompt_len),
            output_len=parse_length_dist(args.output_len),
            num_requests=args.num_requests,
            seed=args.seed,
            max_prompt_len=args.max_prompt_len,
            prompts_file=args.prompts_file,
        )
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        opts = RunOptions(
            concurrency=levels,
            timeout=args.request_timeout,
            max_seconds=args.max_seconds_per_level,
            warmup_requests=args.warmup_requests,
            ignore_eos=args.ignore_eos,
            endpoint=args.endpoint,
            temperature=args.temperature,
            served_model=args.served_model,
            headers=tuple(headers.items()),
            rounds=args.rounds,
        )
        names = parse_names(args.compare) if args.compare else []
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    created = dt.datetime.now().astimezone()
    out_dir = Path(args.out or f"results/bench-{created:%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    make_prompts = PromptMaker(args, spec, headers)
    targets: list[TargetRun]
    if names:
        args.concurrency_levels = levels
        cache = Path(args.model_cache_dir) if args.model_cache_dir else modelfiles.default_cache_dir()
        files = modelfiles.resolve(args.model, args.llama_model, args.hf_model)
        ctx = spec.max_prompt_len + output_bound(spec.output_len) + 16
        comparison = Comparison(args, files, cache, ctx)
        targets = run_compare(names, comparison, opts, out_dir, make_prompts, args.ready_timeout,
                              interleave=args.interleave)
    else:
        url = (args.url or DEFAULT_URL).rstrip("/")
        try:
            waited = wait_until_ready(url, args.ready_timeout)
            prompts, probes = make_prompts(url, None)
            targets = [run_target(url, url, prompts, opts, probes=probes)]
            targets[0].summary["startup"]["waited_for_ready_seconds"] = waited
        except (TokenizerError, WorkloadError, OSError, ServerError) as exc:
            targets = [failed_target(url, url, str(exc))]
    meta: dict[str, Any] = {
        "bench_version": 1,
        "created": created.isoformat(timespec="seconds"),
        "command": sys.argv,
        "workload": spec.describe(),
        "rounds": args.rounds,
        "concurrency": list(levels),
        "tokenizer": make_prompts.tokenizer_name,
        "threads": args.threads if names else None,
        "dtype": args.dtype or None,
        "model": args.model if names else None,
    }
    doc = document(meta, targets)
    files_written = [write_json(out_dir, doc), write_markdown(out_dir, doc)]
    if not args.no_plots:
        pngs, why = write_plots(out_dir, targets)
        files_written += pngs
        if why:
            print(f"[bench] {why}")
    for line in ratio_lines(doc):
        print(line)
    print(f"[bench] wrote {', '.join(str(p) for p in files_written)}")
    return _exit_code(targets)


def _exit_code(targets: list[TargetRun]) -> int:
    """1 when a (not skipped) target failed, a request failed, or a bucketserve target recompiled."""
    problems: list[str] = []
    for t in targets:
        s = t.summary
        if s.get("skipped"):
            continue
        if s.get("error"):
            problems.append(f"{t.name}: {s['error'][:300]}")
        failed = sum(lv["failed"] for lv in s.get("levels", []))
        if failed:
            problems.append(f"{t.name}: {failed} failed requests")
        if isinstance(s.get("recompilations"), (int, float)) and s["recompilations"] > 0:
            problems.append(f"{t.name}: {s['recompilations']:.0f} recompilations during the run (must be 0)")
    for p in problems:
        print(f"[bench] problem: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bucketserve bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
