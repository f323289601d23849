"""POST /v1/completions and POST /v1/chat/completions (OpenAI wire format, streaming and not)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import ApiError
from server.protocol import parse
from server.protocol_openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.routes_common import (
    AppState, bucket_headers, default_max_tokens, endpoint, new_id, prompt_ids, render_chat, state_of, submit_all,
)
from server.routes_runs import STOP_STRING, EventStream, RunResult, SequenceRun, Step, collect_all, merge, sse

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
FINGERPRINT = "bucketserve"
FINISH = {"stop": "stop", STOP_STRING: "stop", "length": "length", "abort": "abort"}


class _Job:
    """One OpenAI request after validation and submission: its runs, ids and response framing."""

    def __init__(self, state: AppState, req: SamplingFields, kind: str, prompts: list[list[int]],
                 max_tokens: int, logprobs: int | None) -> None:
        self.state, self.req, self.kind = state, req, kind
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.created = int(time.time())
        self.prompt_tokens = sum(len(p) for p in prompts)
        n = req.num_choices()
        stops = req.stop_strings()
        seq_prompts = [p for p in prompts for _ in range(n)]
        params = [req.to_params(max_tokens, logprobs, j) for _ in prompts for j in range(n)]
        self.include_usage = req.include_usage()
        self.handles = submit_all(state, seq_prompts, params, self.id)
        tok = state.tokenizer
        self.runs = [SequenceRun(h, tok, p, stops) for h, p in zip(self.handles, seq_prompts)]
        self.headers = bucket_headers(self.handles)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if stream and self.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "system_fingerprint": FINGERPRINT, "choices": choices}

    def abort_all(self) -> None:
        for r in self.runs:
            r.abort("client")


def _token_text(tok: Any, token_id: int) -> str:
    return str(tok.decode([token_id], skip_special_tokens=False))


def _completion_logprobs(tok: Any, steps: Sequence[Step], offset: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for s in steps:
        if s.token_id is None:
            continue
        top: dict[str, float | None] = {_token_text(tok, t): lp for t, lp in s.top_logprobs}
        top.setdefault(_token_text(tok, s.token_id), s.logprob)
        out["tokens"].append(_token_text(tok, s.token_id))
        out["token_logprobs"].append(s.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s.text)
    return out


def _chat_logprobs(tok: Any, steps: Sequence[Step]) -> dict[str, Any]:
    def entry(token_id: int, lp: float | None) -> dict[str, Any]:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for s in steps:
        if s.token_id is not None:
            content.append({**entry(s.token_id, s.logprob),
                            "top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]})
    return {"content": content}


def _raise_engine_error(results: Sequence[RunResult]) -> None:
    for r in results:
        if r.finish_reason == "error":
            raise ApiError(500, f"generation failed: {r.error or 'engine error'}", type="server_error",
                           code="engine_error")


def _stream_error(step: Step) -> bytes:
    return sse({"error": {"message": f"generation failed: {step.error or 'engine error'}", "type": "server_error",
                          "param": None, "code": "engine_error"}})


# -- /v1/completions --------------------------------------------------------------------------------
@endpoint
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, CompletionRequest, state.body_limit)
    state.check_model(req.model)
    req.check_supported()
    raw_prompts = req.prompts()
    prompts = [prompt_ids(state.tokenizer, p) for p in raw_prompts]
    job = _Job(state, req, "text", prompts, req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
    n = req.num_choices()
    echoes = [""] * len(job.runs)
    if req.echo:
        texts = [p if isinstance(p, str) else str(state.tokenizer.decode(ids, skip_special_tokens=True))
                 for p, ids in zip(raw_prompts, prompts)]
        echoes = [t for t in texts for _ in range(n)]
    if req.stream:
        return EventStream(_stream_completions(job, echoes, req.logprobs is not None), job.abort_all, job.headers)
    results = await collect_all(request, job.runs)
    _raise_engine_error(results)
    tok = state.tokenizer
    choices = [
        {"index": k, "text": echoes[k] + r.text,
         "logprobs": _completion_logprobs(tok, r.steps, len(echoes[k])) if req.logprobs is not None else None,
         "finish_reason": FINISH.get(r.finish_reason, r.finish_reason)}
        for k, r in enumerate(results)
    ]
    body = {**job.envelope(choices, stream=False), "usage": job.usage(sum(len(r.tokens) for r in results))}
    return JSONResponse(body, headers=job.headers)


async def _stream_completions(job: _Job, echoes: list[str], logprobs: bool) -> AsyncIterator[bytes]:
    tok = job.state.tokenizer
    usage_field = {"usage": None} if job.include_usage else {}
    offsets = [len(e) for e in echoes]
    generated = 0

    def chunk(k: int, text: str, lp: Any, finish: str | None) -> bytes:
        choice = {"index": k, "text": text, "logprobs": lp, "finish_reason": finish}
        return sse({**job.envelope([choice], stream=True), **usage_field})

    for k, echo in enumerate(echoes):
        if echo:
            yield chunk(k, echo, None, None)
    async for k, step in merge(job.runs):
        generated += step.token_id is not None
        if step.finish_reason == "error":
            yield _stream_error(step)
            continue
        lp = _completion_logprobs(tok, [step], offsets[k]) if logprobs and step.token_id is not None else None
        offsets[k] += len(step.text)
        if step.text or step.finish_reason or lp:
            finish = FINISH.get(step.finish_reason, step.finish_reason) if step.finish_reason else None
            yield chunk(k, step.text, lp, finish)
    if job.include_usage:
        yield sse({**job.envelope([], stream=True), "usage": job.usage(generated)})
    yield b"data: [DONE]\n\n"


# -- /v1/chat/completions ---------------------------------------------------------------------------
@endpoint
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, ChatCompletionRequest, state.body_limit)
    state.check_model(req.model)
    req.check_supported()
    ids = render_chat(state.tokenizer, [m.as_template_dict() for m in req.messages])
    max_tokens = req.max_new_tokens() or default_max_tokens(state, len(ids))
    job = _Job(state, req, "chat", [ids], max_tokens, req.logprobs_k())
    if req.stream:
        return EventStream(_stream_chat(job, bool(req.logprobs)), job.abort_all, job.headers)
    results = await collect_all(request, job.runs)
    _raise_engine_error(results)
    tok = state.tokenizer
    choices = [
        {"index": k, "message": {"role": "assistant", "content": r.text},
         "logprobs": _chat_logprobs(tok, r.steps) if req.logprobs else None,
         "finish_reason": FINISH.get(r.finish_reason, r.finish_reason)}
        for k, r in enumerate(results)
    ]
    body = {**job.envelope(choices, stream=False), "usage": job.usage(sum(len(r.tokens) for r in results))}
    return JSONResponse(body, headers=job.headers)


async def _stream_chat(job: _Job, logprobs: bool) -> AsyncIterator[bytes]:
    tok = job.state.tokenizer
    usage_field = {"usage": None} if job.include_usage else {}
    generated = 0

    def chunk(k: int, content: str | None, lp: Any, finish: str | None) -> bytes:
        # "role" in every delta: harmless for OpenAI clients, required by the text-generation client.
        delta = {"role": "assistant", "content": content, "tool_calls": None}
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**job.envelope([choice], stream=True), **usage_field})

    for k in range(len(job.runs)):
        yield chunk(k, "", None, None)
    async for k, step in merge(job.runs):
        generated += step.token_id is not None
        if step.finish_reason == "error":
            yield _stream_error(step)
            continue
        lp = _chat_logprobs(tok, [step]) if logprobs and step.token_id is not None else None
        if step.text or step.finish_reason or lp:
            finish = FINISH.get(step.finish_reason, step.finish_reason) if step.finish_reason else None
            yield chunk(k, step.text, lp, finish)
    if job.include_usage:
        yield sse({**job.envelope([], stream=True), "usage": job.usage(generated)})
    yield b"data: [DONE]\n\n"
