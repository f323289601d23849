"""The engine: one thread that owns the model, the runner and the scheduler; the event loop only submits
requests and reads token events. Contract: `EngineAPI` in server/engine/interface.py.

Each step reads: schedule -> run the graph for that step -> sample -> scheduler.update -> emit events.
Events cross to the event loop with one `call_soon_threadsafe` per step (not per token).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from buckets.scheduler import WAITING_SERVED_RATIO, ChunkStep, MixedStep, PrefillStep, Scheduler, Sequence, Step
from buckets.speculation import NgramIndex
from models.mesh import MeshError
from models.runner import WarmupCancelled
from models.sampling import SampledToken, SamplingParams
from server.engine.active_request import ActiveRequest
from server.engine.interface import (
    DrainingError,
    EngineAPI,
    EngineDeadError,
    EngineNotReadyError,
    InvalidTokenError,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    WarmupProgress,
    deliver_step,
)
from server.engine.model import CacheMissingError, EngineModel
from server.engine.request_book import RequestBook
from server.engine.step_sampling import verify_drafts
from server.metrics.hooks import MetricsHooks
from server.metrics.safe_hooks import SafeHooks

__all__ = ["Engine"]  # its errors and events: server/engine/interface.py

log = logging.getLogger("bucketserve.engine")


class Engine:
    def __init__(self, model: EngineModel, *, max_waiting_requests: int = 64, max_waiting_tokens: int = 65536,
                 request_timeout: float = 0.0, metrics: MetricsHooks | None = None, batching: str = "continuous",
                 log_prompts: bool = False, waiting_served_ratio: float = WAITING_SERVED_RATIO,
                 prefix_caching: bool = False, speculative_tokens: int = 0) -> None:
        self.model = model
        self.table = model.table
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.eos_token_ids = model.eos_token_ids
        self.vocab_limit = model.vocab_limit  # the one bound on client token ids (HTTP checks against it too)
        self.metrics = SafeHooks(metrics)
        self.request_timeout = request_timeout
        self._scheduler = Scheduler(self.table, max_waiting_requests, max_waiting_tokens, batching,
                                    waiting_served_ratio=waiting_served_ratio, prefix_caching=prefix_caching,
                                    speculative_tokens=speculative_tokens)
        self._book = RequestBook(self._scheduler, self.metrics, request_timeout, self.table.max_batch,
                                 self.tokenizer if log_prompts else None)
        # The book's lock, its condition and its requests: admission and each step's delivery hold them here too.
        self._lock, self._wake, self._active = self._book.lock, self._book.wake, self._book.active
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._failed: str | None = None
        self._not_ready: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="bucketserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        warming = not self.model.is_ready
        self.model.cancel_warmup()
        if self._thread is not None:
            # A compile in progress cannot be interrupted: during warm-up, do not wait it out (the caller
            # exits the process; see `thread_busy`).
            self._thread.join(min(timeout, 2.0) if warming else timeout)
        self.abort_all("drain")

    @property
    def thread_busy(self) -> bool:
        """The engine thread outlived stop(): it is inside a compile that cannot be interrupted."""
        return self._thread is not None and self._thread.is_alive()

    def begin_drain(self) -> None:
        self._draining = True
        self.metrics.set_ready(False)

    def abort_all(self, reason: str, message: str | None = None) -> None:
        """End every waiting and running request with finish_reason 'abort' (drain timeout, shutdown)."""
        for request_id in self._book.ids():
            self.abort(request_id, reason, message)

    def fail(self, message: str) -> None:
        """From any thread: the engine cannot go on (a tensor-parallel rank is gone). /health turns 503 and
        every request ends with an error, even while the engine thread is stuck in a collective."""
        with self._lock:
            if self._failed is None:
                self._failed = message
        log.error("engine failed: %s", message)
        self.metrics.set_ready(False)
        self._book.fail_all(message)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no request is waiting or running (used by graceful drain)."""
        return self._book.wait_idle(timeout)

    # -- state ---------------------------------------------------------------------------------------
    def progress(self) -> WarmupProgress:
        p = self.model.progress
        return WarmupProgress(p.done, p.total, p.elapsed, self.model.is_ready and not self._draining,
                              self._draining, self._failed or self._not_ready, self.model.mesh_info())

    def is_ready(self) -> bool:
        return self.model.is_ready and not self._draining and self.is_alive()

    def is_alive(self) -> bool:
        return self._failed is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    def num_running(self) -> int:
        return self._scheduler.num_running

    def num_waiting(self) -> int:
        return self._scheduler.num_waiting

    def retry_after(self) -> float:
        """Seconds until a queued request is likely to start, from the measured completion rate."""
        return self._book.retry_after()

    # -- requests (event-loop side) --------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        return self.submit_many([prompt_ids], [params], [request_id or f"req-{uuid.uuid4().hex[:16]}"])[0]

    def submit_many(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str], *,
                    settled_by_client: bool = False) -> list[RequestHandle]:
        """Admit several sequences (the n choices of one request) atomically: all are queued, or none is
        and the refusal propagates. Each is checked against the bucket table once (Scheduler.add_many).
        settled_by_client: the caller matches stop strings and settles each handle (RequestBook.hold)."""
        limit = self.vocab_limit
        for prompt_ids in prompts:
            for token in prompt_ids:
                if not 0 <= token < limit:
                    raise InvalidTokenError(token, limit)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        deadline = now + self.request_timeout if self.request_timeout > 0 else float("inf")
        with self._wake:
            # Checked under the lock: a failing engine clears _active under it, so no request slips in after.
            if self._failed is not None or self._stopping or (self._thread is not None and not self._thread.is_alive()):
                raise EngineDeadError(f"the engine has stopped: {self._failed or 'shutting down'}")
            if self._draining:
                raise DrainingError(self.retry_after())
            if not self.model.is_ready:
                raise EngineNotReadyError(max(1.0, self.model.progress.eta()))
            if len(set(request_ids)) < len(request_ids) or any(rid in self._active for rid in request_ids):
                raise ValueError(f"request ids {request_ids!r} are already in use")
            speculates = bool(self._scheduler.speculative_tokens)  # and per request: SamplingParams.takes_drafts
            seqs = [Sequence(rid, len(prompt_ids), p.max_tokens,
                             frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids),
                             prompt_ids=tuple(prompt_ids) if self._scheduler.prefix_caching else (),
                             ngrams=NgramIndex(prompt_ids) if speculates and p.takes_drafts else None)
                    for prompt_ids, p, rid in zip(prompts, params, request_ids, strict=True)]
            samplers = [self.model.sampler(p, prompt_ids) for prompt_ids, p in zip(prompts, params)]
            try:
                self._scheduler.add_many(seqs)  # all or none
            except QueueFullError as exc:
                exc.retry_after = self.retry_after()
                raise
            handles = []
            for prompt_ids, sampler, seq in zip(prompts, samplers, seqs):
                handle = RequestHandle(seq.request_id, len(prompt_ids), seq.bucket, seq.bucket - len(prompt_ids),
                                       loop, self.abort, self._book.settle if settled_by_client else None)
                self._active[seq.request_id] = ActiveRequest(handle, seq, sampler, prompt_ids, now, deadline)
                handles.append(handle)
            self._wake.notify_all()
        return handles

    def abort(self, request_id: str, reason: str = "client", message: str | None = None) -> None:
        """Thread-safe; frees the slot before the next step. The stream ends with finish_reason 'abort'."""
        self._book.abort(request_id, reason, message)

    # -- the engine thread -------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.model.load_and_warm()
        except WarmupCancelled:
            log.info("warm-up cancelled: shutting down")
            return
        except CacheMissingError as exc:
            # Alive but never ready: /health 200, /ready 503 with the reason, until stopped.
            log.error("%s", exc)
            self._not_ready = str(exc)
            with self._wake:
                while not self._stopping:
                    self._wake.wait(1.0)
            return
        except Exception as exc:  # noqa: BLE001 - any load/warm-up failure makes the server unhealthy
            log.exception("engine failed to load or warm up")
            self._failed = f"{type(exc).__name__}: {exc}"
            self._book.fail_all(self._failed)
            return
        try:
            while True:
                self.model.tick()  # tensor parallel: heartbeat the followers when idle
                with self._wake:
                    if self._stopping or self._failed is not None:
                        return
                    expired = self._book.expired()
                    step = None if expired else self._scheduler.schedule()
                    if step is None and not expired:
                        self._book.publish_load()
                        self._wake.wait(0.5)
                        continue
                    prompts = self._book.prompts(step)
                    stalls = self._scheduler.num_decoding if isinstance(step, (PrefillStep, ChunkStep)) else 0
                for rid in expired:
                    self.abort(rid, "timeout", "request timed out")
                self._book.sweep_held(time.monotonic())
                if step is not None:
                    t0 = time.monotonic()
                    self._run(step, prompts)
                    if stalls:
                        self.metrics.decode_stalled(time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the engine cannot continue: /health turns 503
            log.exception("engine loop failed")
            self.fail(f"{type(exc).__name__}: {exc}")
        finally:
            self.model.close()

    def _run(self, step: Step, prompts: dict[str, list[int]]) -> None:
        t0 = time.perf_counter()
        with self._lock:  # whether the step's logits serve only greedy tokens (models/greedy_head.py)
            maxima = all(a is None or a.sampler.params.takes_drafts
                         for a in map(self._active.get, (seq.request_id for seq in step.sampling_seqs)))
        try:
            logits = self.model.run_step(step, prompts.__getitem__, maxima=maxima)
        except MeshError:
            raise  # the ranks are out of step: the engine cannot go on
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the others
            log.exception("step %s failed", type(step).__name__)
            # A failed mixed step fails the prompts it carried; its decoding rows just run again next step (their
            # token is rewritten at the same position), as they would have after a failed prefill.
            failed = tuple(p.seq for p in step.pieces) if isinstance(step, MixedStep) else step.seqs
            for seq in failed:
                self._book.finish_error(seq.request_id, f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self._scheduler.discard(seq)  # what the failed step wrote (or copied) there is not known
            return
        with self._lock:
            owners = [self._active.get(seq.request_id) for seq in step.sampling_seqs]
        # Sampling runs outside the lock: each sampler belongs to its request and to this thread alone.
        tokens = self.model.sample(step.sampling_seqs, [a.sampler if a else None for a in owners], logits)
        verified = verify_drafts(step, tokens, logits) if isinstance(step, MixedStep) else {}
        seconds = time.perf_counter() - t0  # the step's compute: its graph and its sampling
        sampled: dict[str, SampledToken] = {}
        for seq, token in zip(step.sampling_seqs, tokens):
            if isinstance(token, Exception):  # one request's failure is that request's alone
                self._book.finish_error(seq.request_id, f"sampling failed: {token}")
            elif token is not None:
                sampled[seq.request_id] = token
        now = time.monotonic()
        out: list[tuple[ActiveRequest, list[TokenEvent]]] = []
        with self._lock:
            self._scheduler.observe(step, seconds)
            live = {rid: tok for rid, tok in sampled.items() if rid in self._active}
            before = {seq.request_id: seq.num_generated for seq in step.sampling_seqs}
            finished = {s.request_id: s.finish_reason for s in self._scheduler.update(
                step, {rid: verified[rid].tokens if rid in verified else tok.token_id for rid, tok in live.items()})}
            for seq in step.sampling_seqs:
                tok = live.get(seq.request_id)
                if tok is None:
                    continue
                rid, reason = seq.request_id, finished.get(seq.request_id)
                active = self._active.pop(rid) if reason is not None else self._active[rid]
                if reason is not None:
                    self._book.hold(active, reason)
                if rid in verified:  # a verify step's row: the tokens update() took (none after a stop)
                    check = verified[rid]
                    ids = check.tokens[: seq.num_generated - before[rid]]
                    self.metrics.speculated(check.drafts, len(ids) - 1)  # the accepted drafts it delivers
                    out.append((active, [TokenEvent(t, None, (), reason if i == len(ids) - 1 else None)
                                         for i, t in enumerate(ids)]))
                else:
                    out.append((active, [TokenEvent(tok.token_id, tok.logprob, tok.top_logprobs, reason)]))
        deliver_step([(active.handle, events) for active, events in out])
        for active, events in out:  # one delivery a step (vLLM observes one inter-token gap per step too)
            self._book.account_token(active, now, events[-1].finish_reason)
        self._book.publish_load()


def _satisfies_engine_api(engine: Engine) -> EngineAPI:
    return engine  # mypy: Engine is what the HTTP layer's EngineAPI describes
