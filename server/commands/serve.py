"""`bucketserve serve`: build the engine, metrics and app, and run uvicorn with a graceful drain.

On SIGTERM / SIGINT the first time: /ready turns 503 and new requests get 503 + Retry-After while the
listener stays open (so a load balancer sees the drain rather than refused connections); in-flight
requests run to completion up to --drain-timeout; then whatever is left ends with finish_reason "abort",
uvicorn shuts down and the process exits 0. A second signal cuts the drain short: every request still running
ends at once with finish_reason "abort" (streams get their final event), and the server shuts down as after a drain
(exit 0). A third exits without waiting for anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import uvicorn
from prometheus_client import disable_created_metrics

from models.mesh import MeshSpec
from server.commands.tp_launch import RankLaunch, run_ranked
from server.compose import build_engine
from server.config import ServerSettings
from server.engine.engine import Engine

log = logging.getLogger("bucketserve.serve")


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first exit signal drains the engine before shutting down."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._draining = False
        self._cut = False  # a second signal cut the drain short

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._cut:  # a third: uvicorn's own forced exit (handlers cancelled mid-response)
            log.warning("signal %d a third time: exiting without waiting", sig)
            self.force_exit = True
            self.should_exit = True
            return
        if self._draining:
            # Not uvicorn's forced exit: that cancels every handler mid-stream (clients saw a truncated chunked
            # body, the log a CancelledError traceback per request) and skips the app's shutdown, so the engine
            # thread was never stopped. Ending the requests lets each stream write its final event and the
            # server shut down as after a drain, in moments.
            self._cut = True
            log.warning("signal %d again: cutting the drain short, ending every request now", sig)
            self.engine.abort_all("drain", "the server is shutting down")
            self.should_exit = True
            return
        self._draining = True
        log.info("signal %d: draining (up to %.0f s), /ready is now 503", sig, self.drain_timeout)
        self.engine.begin_drain()
        threading.Thread(target=self._finish_drain, name="bucketserve-drain", daemon=True).start()

    def _finish_drain(self) -> None:
        idle = self.engine.wait_idle(self.drain_timeout)
        if self._cut:
            return  # handle_exit ended the requests and the server
        log.info("drain %s; shutting down", "complete" if idle else "timed out, aborting the rest")
        if not idle:
            # End what is left with a final event (finish_reason "abort") while clients still read,
            # then give the handlers a moment to write it before uvicorn closes the connections.
            self.engine.abort_all("drain", "the server is shutting down")
            self.engine.wait_idle(2.0)
            time.sleep(0.5)
        self.should_exit = True


def serve_main(settings: ServerSettings) -> int:
    return run_ranked(settings, lambda spec, launch: _serve(settings, spec, launch))


def _serve(settings: ServerSettings, mesh_spec: MeshSpec | None, launch: RankLaunch) -> int:
    """Rank 0 (or the only process): HTTP, scheduler and engine. Returns 1 when the mesh broke."""
    from server.commands.tp_watchdog import MeshWatchdog
    from server.http.app import create_app

    disable_created_metrics()  # no *_created series: half the lines, none of the value
    engine, metrics = build_engine(settings, mesh_spec=mesh_spec)
    if mesh_spec is not None:
        log.info("tensor-parallel mesh: %s; rank 0 serves HTTP", mesh_spec.describe())
    app = create_app(engine, settings, metrics)
    # log_config=None: uvicorn's loggers propagate to our handlers (text or JSON); no access log, since
    # the engine writes one line per request with the facts that matter (bucket, tokens, TTFT, status).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="on")
    server = DrainingServer(config, engine, settings.drain_timeout)
    watchdog = None
    if mesh_spec is not None:
        watchdog = MeshWatchdog(engine, launch, lambda: setattr(server, "should_exit", True))
        watchdog.start()
    startup_failed = False
    try:
        asyncio.run(server.serve())
    except SystemExit:  # uvicorn's way out when it cannot start (a port in use): logged, app shut down
        startup_failed = True
    finally:
        if watchdog is not None:
            watchdog.stop()
    failed = startup_failed or (watchdog is not None and watchdog.failure is not None)
    if failed and not startup_failed:
        log.error("exiting with status 1: %s", watchdog.failure if watchdog else "")
    if engine.thread_busy:
        # Stopped during warm-up while a graph compiles (or the port was taken while the model loads): nothing can
        # interrupt it, and Python's exit would join inductor's compile pools (minutes), or abort in C++ while
        # the thread still runs. Builder processes are already gone (cancel_warmup).
        log.warning("exiting during warm-up; the model load or graph compile under way is abandoned")
        logging.shutdown()
        os._exit(1 if failed else 0)
    if failed:
        return 1
    return 0
