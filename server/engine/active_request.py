"""The engine's record of one admitted request, and what is logged and measured when it ends."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from buckets.scheduler import Sequence
from server.engine.interface import RequestHandle

request_log = logging.getLogger("bucketserve.requests")


@dataclass
class ActiveRequest:
    """Engine-side state of one request (written by the engine thread after admission)."""

    handle: RequestHandle
    seq: Sequence
    sampler: Any
    prompt_ids: list[int]
    arrival: float
    deadline: float
    started: bool = False
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    gaps: list[float] = field(default_factory=list)  # inter-token latencies, observed at the end

    def on_token(self, now: float, reason: str | None, metrics: Any, tokenizer: Any = None) -> None:
        """A token was delivered; `reason` is set on the request's last one."""
        if self.first_token_at == 0.0:
            self.first_token_at = now
            metrics.first_token(self.seq.bucket, now - self.arrival)
            metrics.prefill_chunks(self.seq.num_chunks)
        else:
            self.gaps.append(now - self.last_token_at)
        self.last_token_at = now
        if reason is not None:
            self.finish(reason, now, metrics, tokenizer)

    def finish(self, reason: str, now: float, metrics: Any, tokenizer: Any = None) -> None:
        """The request ended with its last token at `now` (`stop` or `length`): request log and metrics."""
        self.log(reason, now, tokenizer)
        metrics.request_finished(self.seq.bucket, now - self.arrival, self.seq.num_generated, self.gaps, reason)

    def on_end(self, abort_reason: str, finish_reason: str, metrics: Any, tokenizer: Any = None) -> None:
        """The request ended without a final token (abort, timeout, error, stop string)."""
        now = time.monotonic()
        self.log(abort_reason if finish_reason == "abort" else finish_reason, now, tokenizer)
        if abort_reason != "stop_string":
            metrics.request_aborted(abort_reason)
        if self.started:
            metrics.request_finished(self.seq.bucket, now - self.arrival, self.seq.num_generated, self.gaps,
                                     finish_reason)

    def log(self, status: str, now: float, tokenizer: Any = None) -> None:
        """One line per request at completion; the prompt text only when a tokenizer is given (--log-prompts)."""
        seq = self.seq
        ttft = round(self.first_token_at - self.arrival, 4) if self.first_token_at else None
        fields: dict[str, Any] = {"request_id": self.handle.request_id, "bucket": seq.bucket,
                                  "prompt_tokens": seq.prompt_len, "output_tokens": seq.num_generated,
                                  "ttft_s": ttft, "duration_s": round(now - self.arrival, 4), "status": status}
        try:
            if tokenizer is not None:
                fields["prompt"] = tokenizer.decode(self.prompt_ids)
            request_log.info("request %s bucket=%d prompt=%d output=%d ttft=%s duration=%.3fs status=%s",
                             fields["request_id"], seq.bucket, seq.prompt_len, seq.num_generated, ttft,
                             fields["duration_s"], status, extra=fields)
        except Exception:  # noqa: BLE001 - logging must not break a request
            pass
