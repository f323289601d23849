"""Running the two ranks of tp_rank.py as processes (gloo on 127.0.0.1) and reading rank 0's results."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("tp_rank.py")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_ranks(checkpoint: str, backend: str, out: Path, timeout: float = 240.0) -> dict[str, Any]:
    """Both ranks of tp_rank.py; raises with both logs when either fails or runs past `timeout`."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = open(out.with_suffix(f".rank{rank}.log"), "wb")
        procs.append((subprocess.Popen([sys.executable, str(RANK_SCRIPT), checkpoint, backend, str(out)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    try:
        for proc, _ in procs:
            codes.append(proc.wait(timeout))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if codes != [0, 0]:
        logs = "\n".join(out.with_suffix(f".rank{r}.log").read_text(errors="replace")[-3000:] for r in (0, 1))
        raise AssertionError(f"ranks exited with {codes}:\n{logs}")
    return torch.load(out)  # type: ignore[no-any-return]
