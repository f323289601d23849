"""One streaming request: build the body, time every chunk, classify failures."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.prompts import Prompt
from bench.sse import SSEDecoder, interpret

PROMPT_FORMATS = ("ids", "text")
EOS_MODES = ("ignore_eos", "generation_config", "none")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class ApiMode:
    """How to talk to one server; found by probing (see runner.probe_mode)."""

    endpoint: str = "completions"
    prompt_format: str = "ids"  # token ids (exact length) or text
    eos: str = "ignore_eos"  # how to make the server generate exactly max_tokens
    model: str | None = None
    temperature: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in (("endpoint", ENDPOINTS), ("prompt_format", PROMPT_FORMATS), ("eos", EOS_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.endpoint == "chat" and self.prompt_format == "ids":
            raise ValueError("prompt_format 'ids' is not possible with the chat endpoint")

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


def build_body(prompt: Prompt, mode: ApiMode) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": prompt.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": mode.temperature,
    }
    if mode.model:
        body["model"] = mode.model
    if mode.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = list(prompt.ids) if mode.prompt_format == "ids" else prompt.text
    if mode.eos == "ignore_eos":
        body["ignore_eos"] = True
    elif mode.eos == "generation_config":
        # transformers serve rejects ignore_eos but takes a GenerationConfig as JSON; min = max forces the length
        n = prompt.output_len
        cfg: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": mode.temperature > 0}
        if mode.temperature > 0:
            cfg["temperature"] = mode.temperature
        body["generation_config"] = json.dumps(cfg)
    return body


def next_pow2(n: int) -> int:
    """Bucket of a prompt when the server does not say (no x-bucket header)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def classify_exception(exc: BaseException) -> str:
    """Failure type of a transport exception: timeout, connection_error or protocol_error."""
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return "connection_error"
    return "protocol_error"


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    bucket: int
    start: float  # perf_counter at send
    ok: bool = False
    error: str | None = None  # failure type: http_<status> | timeout | connection_error | stream_error | ...
    detail: str = ""
    status: int | None = None
    ttft: float | None = None  # seconds from send to the first token-bearing chunk
    e2e: float | None = None  # seconds from send to the end of the stream
    token_times: list[float] = field(default_factory=list)  # seconds from send, per token-bearing chunk
    output_tokens: int = 0  # usage.completion_tokens when reported, else token-bearing chunks
    finish_reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("start", "token_times")}


def _bucket_from(header: str, prompt_tokens: int) -> int:
    return int(header) if header.isdigit() else next_pow2(prompt_tokens)


async def stream_request(
    client: httpx.AsyncClient, base_url: str, prompt: Prompt, mode: ApiMode
) -> RequestResult:
    """Send one streaming request and time it; never raises for server or network trouble."""
    prompt_tokens = len(prompt.ids) if mode.prompt_format == "ids" else prompt.text_tokens
    start = time.perf_counter()
    res = RequestResult(prompt.index, prompt_tokens, next_pow2(prompt_tokens), start)
    counted, usage_tokens, done = 0, None, False
    try:
        async with client.stream("POST", base_url.rstrip("/") + mode.path, json=build_body(prompt, mode)) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"http_{resp.status_code}"
                res.detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                res.e2e = time.perf_counter() - start
                return res
            header = resp.headers.get("x-bucket", "").strip()
            decoder = SSEDecoder()
            async for text in resp.aiter_text():
                now = time.perf_counter() - start
                for payload in decoder.feed(text):
                    chunk = interpret(payload)
                    if chunk.error is not None:
                        res.error, res.detail = "stream_error", chunk.error[:300]
                        res.e2e = now
                        return res
                    done = done or chunk.done
                    if chunk.tokens:
                        counted += chunk.tokens
                        res.token_times.append(now)
                    if chunk.finish_reason is not None:
                        res.finish_reason = chunk.finish_reason
                    if chunk.completion_tokens is not None:
                        usage_tokens = chunk.completion_tokens
                    if chunk.prompt_tokens is not None:
                        res.prompt_tokens = chunk.prompt_tokens
            for payload in decoder.close():
                done = done or interpret(payload).done
            # usage may correct the prompt length (text prompts), so the fallback bucket is taken last
            res.bucket = _bucket_from(header, res.prompt_tokens)
    except httpx.HTTPError as exc:
        res.error, res.detail = classify_exception(exc), repr(exc)[:300]
        res.e2e = time.perf_counter() - start
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = usage_tokens if usage_tokens is not None else counted
    res.ttft = res.token_times[0] if res.token_times else None
    if res.finish_reason is None and not done:
        res.error, res.detail = "incomplete_stream", "stream ended without finish_reason or [DONE]"
    elif not res.token_times:
        res.error, res.detail = "no_tokens", "stream finished without any token"
    else:
        res.ok = True
    return res
