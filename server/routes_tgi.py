"""Hugging Face text-generation-inference routes: POST /generate, POST /generate_stream and POST /
(which the `text-generation` client uses for both, switching on `stream`; non-streaming it answers
a one-element list). JSON shapes follow text_generation.types (Response, StreamResponse, Details, Token).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.errors import ApiError
from server.protocol import parse
from server.protocol_tgi import TgiParameters, TgiRequest
from server.routes_common import bucket_headers, endpoint, new_id, prompt_ids, state_of, submit_all
from server.routes_runs import STOP_STRING, EventStream, SequenceRun, Step, collect_all, merge, sse

FINISH = {"stop": "eos_token", STOP_STRING: "stop_sequence", "length": "length"}


class _TgiJob:
    def __init__(self, request: Request, req: TgiRequest) -> None:
        self.state = state = state_of(request)
        self.tok = state.tokenizer
        self.p: TgiParameters = req.params()
        ids = prompt_ids(self.tok, req.inputs, "inputs")
        if self.p.truncate is not None:
            ids = ids[-self.p.truncate :]  # TGI keeps the last `truncate` tokens
        self.ids = ids
        self.prefix = req.inputs if self.p.return_full_text else ""
        params = self.p.to_params()
        self.seed = self.p.seed if self.p.sampling() else None
        handles = submit_all(state, [ids], [params], new_id("tgi"))
        self.run = SequenceRun(handles[0], self.tok, ids, self.p.stop or [], hold_back=False)
        self.headers = bucket_headers(handles)
        self.special = set(getattr(self.tok, "all_special_ids", []))

    def token(self, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        special = token_id in self.special
        if special:
            text = str(self.tok.decode([token_id], skip_special_tokens=False))
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def alternatives(self, step: Step) -> list[dict[str, Any]]:
        return [self.token(t, str(self.tok.decode([t], skip_special_tokens=True)), lp) for t, lp in step.top_logprobs]

    def finish(self, reason: str | None, error: str | None) -> str:
        if reason == "error":
            raise ApiError(500, f"generation failed: {error or 'engine error'}", type="server_error",
                           code="engine_error")
        if reason not in FINISH:
            raise ApiError(503, "the request was aborted by the server before it finished",
                           type="service_unavailable_error", code="aborted")
        return FINISH[reason]

    async def respond(self, request: Request) -> dict[str, Any]:
        (result,) = await collect_all(request, [self.run])
        finish = self.finish(result.finish_reason, result.error)
        body: dict[str, Any] = {"generated_text": self.prefix + result.text}
        if self.p.details:
            steps = result.tokens
            body["details"] = {
                "finish_reason": finish,
                "generated_tokens": len(steps),
                "seed": self.seed,
                "prefill": [self.token(t, str(self.tok.decode([t], skip_special_tokens=False)), None)
                            for t in self.ids] if self.p.decoder_input_details else [],
                "tokens": [self.token(s.token_id, s.text, s.logprob) for s in steps if s.token_id is not None],
                "top_tokens": [self.alternatives(s) for s in steps] if self.p.top_n_tokens else None,
                "best_of_sequences": None,
            }
        return body

    async def stream(self) -> AsyncIterator[bytes]:
        count = 0
        async for _, step in merge([self.run]):
            if step.token_id is None:  # a final event without a token: aborted or failed
                message = step.error or "the request was aborted by the server before it finished"
                yield sse({"error": message, "error_type": "generation"})
                return
            count += 1
            event: dict[str, Any] = {
                "index": count,
                "token": self.token(step.token_id, step.text, step.logprob),
                "top_tokens": self.alternatives(step) if self.p.top_n_tokens else None,
                "generated_text": None,
                "details": None,
            }
            if step.finish_reason is not None:
                try:
                    finish = self.finish(step.finish_reason, step.error)
                except ApiError as exc:
                    yield sse({"error": exc.message, "error_type": "generation"})
                    return
                event["generated_text"] = self.prefix + self.run.stopper.text
                if self.p.details:
                    event["details"] = {"finish_reason": finish, "generated_tokens": count, "seed": self.seed}
            yield sse(event)


async def _job(request: Request) -> tuple[_TgiJob, bool]:
    state = state_of(request)
    req = await parse(request, TgiRequest, state.body_limit)
    return _TgiJob(request, req), bool(req.stream)


@endpoint
async def generate(request: Request) -> Response:
    job, _ = await _job(request)
    return JSONResponse(await job.respond(request), headers=job.headers)


@endpoint
async def generate_stream(request: Request) -> Response:
    job, _ = await _job(request)
    return EventStream(job.stream(), job.run.abort, job.headers)


@endpoint
async def root(request: Request) -> Response:
    """POST / - what the text-generation client calls: a list of one response, or a stream."""
    job, stream = await _job(request)
    if stream:
        return EventStream(job.stream(), job.run.abort, job.headers)
    return JSONResponse([await job.respond(request)], headers=job.headers)
