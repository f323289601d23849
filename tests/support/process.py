"""A real `bucketserve serve` process (python -m server.cli) on a free port, for the operations tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TINY_FLAGS = ["--buckets", "8,16,32,64", "--batch-sizes", "1,2,4", "--prefill-batch-sizes", "1,2",
              "--max-model-len", "128", "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, model: str, *flags: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", model, "--port",
                                      str(self.port), *flags], stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready: " + self.log_path.read_text()[-3000:])

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                   or line.startswith(name + "{"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
