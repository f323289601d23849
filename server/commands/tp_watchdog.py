"""Rank 0's watchdog over a tensor-parallel server: a broken mesh ends the server with a non-zero exit.

A follower that exits (its process, when rank 0 started it) fails the engine at once; a follower that is
hung or gone under torchrun is found by the engine thread itself (a step's collective or the idle heartbeat
raises MeshError within --tp-timeout). Either way the engine fails: /health turns 503, every request ends
with an error; then, after `grace` seconds for those errors to reach their clients, uvicorn is told to exit
and `serve` returns 1 (so Kubernetes restarts the pod). Started and stopped by server.serve.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from server.commands.tp_launch import RankLaunch
from server.engine.engine import Engine

log = logging.getLogger("bucketserve.mesh")


class MeshWatchdog:
    def __init__(self, engine: Engine, launch: RankLaunch, exit_server: Callable[[], Any], *,
                 poll: float = 0.2, grace: float = 1.0) -> None:
        self.engine = engine
        self.launch = launch
        self.exit_server = exit_server
        self.poll = poll
        self.grace = grace
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="bucketserve-mesh-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _main(self) -> None:
        while not self._stop.wait(self.poll):
            dead = self.launch.dead_follower()
            if dead is not None and self.engine.is_alive():
                self.engine.fail(dead)
            if not self.engine.is_alive():
                self.failure = self.engine.progress().failed or dead or "the engine stopped"
                log.error("tensor-parallel mesh broken (%s): exiting in %.1f s", self.failure, self.grace)
                time.sleep(self.grace)
                self.exit_server()
                return
