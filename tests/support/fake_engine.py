"""A fake engine satisfying `EngineAPI` (server/engine/interface.py; mypy checks it) for fast HTTP-layer tests.

It runs a real thread and delivers events through the real `RequestHandle` (call_soon_threadsafe), but
"generates" deterministically: greedy requests echo the prompt's non-special tokens cyclically; sampled
requests draw from a `random.Random(seed)` over the non-special vocabulary. EOS / stop_token_ids /
max_tokens are honoured like the real engine. Knobs: `hold` pauses generation, `fail()` kills it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buckets import BucketTable
from models.params import SamplingParams
from server.engine.interface import (
    DrainingError,
    EngineAPI,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    RequestHandle,
    TokenEvent,
    WarmupProgress,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('role bad is not allowed') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
CORPUS = [
    "hello world, the cat sat on the mat.", "Héllo wörld — naïve café résumé", "日本語のテキスト と 漢字",
    "emoji 😀 🚀 ✨ party", "the quick brown fox jumps over the lazy dog 0123456789", "STOP here stop there",
] * 20


def build_tokenizer(path: str | Path) -> Any:
    """A byte-level BPE tokenizer (multi-byte characters split across tokens) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    if not (out / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        fast.chat_template = CHAT_TEMPLATE
        out.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(out)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)


@dataclass
class _Req:
    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    generated: int = 0
    stop_ids: frozenset[int] = field(default_factory=frozenset)


class FakeEngine:
    def __init__(self, tokenizer: Any, table: BucketTable, *, model_name: str = "fake-model",
                 step_delay: float = 0.002, warmup_delay: float = 0.0, max_waiting: int = 64) -> None:
        self.tokenizer = tokenizer
        self.table = table
        self.model_name = model_name
        self.eos_token_ids = frozenset({int(tokenizer.eos_token_id)})
        self.vocab_limit = len(tokenizer)
        self.step_delay = step_delay
        self.warmup_delay = warmup_delay
        self.max_waiting = max_waiting
        self.hold = threading.Event()  # set: generation paused
        self._special = set(tokenizer.all_special_ids)
        self._normal = [i for i in range(len(tokenizer)) if i not in self._special]
        self._lock = threading.Lock()
        self._active: dict[str, _Req] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._failed: str | None = None
        self._done = 0
        self._t0 = time.monotonic()
        self.submitted: list[tuple[list[int], SamplingParams]] = []
        self.aborts: list[tuple[str, str]] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._main, name="fake-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            self._thread.join(5)
        self._end_all("abort", None)

    def begin_drain(self) -> None:
        self._draining = True

    def fail(self, message: str = "boom") -> None:
        self._failed = message
        self._end_all("error", message)

    def progress(self) -> WarmupProgress:
        return WarmupProgress(self._done, self.table.num_graphs, time.monotonic() - self._t0, self.is_ready(),
                              self._draining, self._failed)

    def is_ready(self) -> bool:
        return self._done == self.table.num_graphs and not self._draining and self._failed is None

    def is_alive(self) -> bool:
        return self._failed is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    def num_running(self) -> int:
        return len(self._active)

    def num_waiting(self) -> int:
        return 0

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestHandle:
        return self.submit_many([prompt_ids], [params], [request_id or uuid.uuid4().hex])[0]

    def submit_many(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str], *,
                    settled_by_client: bool = False) -> list[RequestHandle]:
        """All or none, like the real engine: every check runs before anything is queued."""
        if self._failed is not None:
            raise EngineDeadError(self._failed)
        if self._draining:
            raise DrainingError(2.0)
        if self._done < self.table.num_graphs:
            raise EngineNotReadyError(3.0)
        buckets = [self.table.check_request(len(ids), p.max_tokens) for ids, p in zip(prompts, params, strict=True)]
        assert all(0 <= t < self.vocab_limit for ids in prompts for t in ids), "HTTP layer let a bad token id through"
        loop = asyncio.get_running_loop()
        handles = []
        with self._lock:
            if len(self._active) + len(prompts) > self.max_waiting:
                raise QueueFullError("requests", self.max_waiting, retry_after=4.0)
            for ids, p, rid, bucket in zip(prompts, params, request_ids, buckets):
                handle = RequestHandle(rid, len(ids), bucket, bucket - len(ids), loop, self.abort)
                stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
                self._active[rid] = _Req(handle, list(ids), p, random.Random(p.seed), stop_ids=stop_ids)
                self.submitted.append((list(ids), p))
                handles.append(handle)
        return handles

    def abort(self, request_id: str, reason: str = "client") -> None:
        with self._lock:
            req = self._active.pop(request_id, None)
        if req is not None:
            self.aborts.append((request_id, reason))
            req.handle.push([TokenEvent(None, None, (), "abort")])

    # -- the fake engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        while self._done < self.table.num_graphs and not self._stopping:
            time.sleep(self.warmup_delay)
            self._done += 1
        while not self._stopping and self._failed is None:
            time.sleep(self.step_delay)
            if self.hold.is_set():
                continue
            with self._lock:
                reqs = list(self._active.values())
                for req in reqs:
                    event = self._next(req)
                    if event.finish_reason is not None:
                        self._active.pop(req.handle.request_id, None)
                    req.handle.push([event])

    def _next(self, req: _Req) -> TokenEvent:
        p = req.params
        if p.is_greedy:
            echo = [t for t in req.prompt if t not in self._special or t in req.stop_ids] or self._normal[:1]
            token = echo[req.generated % len(echo)]
        else:
            token = req.rng.choice(self._normal)
        req.generated += 1
        reason = "stop" if token in req.stop_ids else "length" if req.generated >= p.max_tokens else None
        logprob = top = None
        if p.logprobs is not None:
            logprob = -0.5
            top = tuple(((token + j) % len(self.tokenizer), -0.5 - 0.25 * j) for j in range(p.logprobs))
        return TokenEvent(token, logprob, top or (), reason)

    def _end_all(self, reason: str, message: str | None) -> None:
        with self._lock:
            reqs = list(self._active.values())
            self._active.clear()
        for req in reqs:
            req.handle.push([TokenEvent(None, None, (), reason, message)])


def _satisfies_engine_api(engine: FakeEngine) -> EngineAPI:
    return engine  # mypy: FakeEngine is an EngineAPI
