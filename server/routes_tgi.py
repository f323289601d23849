"""Hugging Face text-generation-inference routes: POST /generate, POST /generate_stream and POST /
(which the `text-generation` client uses for both, switching on `stream`; non-streaming it answers
a one-element list). JSON shapes follow text_generation.types (Response, StreamResponse, Details, Token);
`TgiFormat` spells them for the shared output path (server.output).
"""

from __future__ import annotations

from typing import Any, Iterable

from starlette.requests import Request
from starlette.responses import Response

from server.admission import Generation, admit
from server.engine_types import FinishReason
from server.errors import ApiError
from server.output import stream_response, whole_response
from server.protocol import parse
from server.protocol_tgi import TgiParameters, TgiRequest
from server.routes_common import new_id, prompt_ids, state_of
from server.routes_runs import RunResult, TextDelta, sse

ABORTED = "the request was aborted by the server before it finished"


class TgiFormat:
    def __init__(self, tokenizer: Any, p: TgiParameters, ids: list[int], prefix: str, gen: Generation,
                 as_list: bool = False) -> None:
        self.tok, self.p, self.ids, self.prefix, self.gen = tokenizer, p, ids, prefix, gen
        self.as_list = as_list  # POST / answers a list of one response
        self.seed = p.seed if p.sampling() else None
        self.special = set(getattr(tokenizer, "all_special_ids", []))
        self.count = 0

    def token(self, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        special = token_id in self.special
        if special:
            text = str(self.tok.decode([token_id], skip_special_tokens=False))
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    def alternatives(self, delta: TextDelta) -> list[dict[str, Any]]:
        return [self.token(t, str(self.tok.decode([t], skip_special_tokens=True)), lp) for t, lp in delta.top_logprobs]

    @staticmethod
    def finish(reason: FinishReason, error: str | None) -> str:
        if reason is FinishReason.ERROR:
            raise ApiError(500, f"generation failed: {error or 'engine error'}", type="server_error",
                           code="engine_error")
        if reason.tgi is None:
            raise ApiError(503, ABORTED, type="service_unavailable_error", code="aborted")
        return reason.tgi

    # -- OutputFormat ----------------------------------------------------------------------------------
    def opening(self) -> Iterable[bytes]:
        return ()

    def event(self, index: int, delta: TextDelta) -> bytes | None:
        if delta.token_id is None:  # a final event without a token: aborted or failed
            return sse({"error": delta.error or ABORTED, "error_type": "generation"})
        self.count += 1
        event: dict[str, Any] = {
            "index": self.count,
            "token": self.token(delta.token_id, delta.text, delta.logprob),
            "top_tokens": self.alternatives(delta) if self.p.top_n_tokens else None,
            "generated_text": None,
            "details": None,
        }
        if delta.finish_reason is not None:
            try:
                finish = self.finish(delta.finish_reason, delta.error)
            except ApiError as exc:
                return sse({"error": exc.message, "error_type": "generation"})
            event["generated_text"] = self.prefix + self.gen.runs[index].stopper.text
            if self.p.details:
                event["details"] = {"finish_reason": finish, "generated_tokens": self.count, "seed": self.seed}
        return sse(event)

    def closing(self) -> Iterable[bytes]:
        return ()

    def body(self, results: list[RunResult]) -> Any:
        (result,) = results
        finish = self.finish(result.finish_reason, result.error)
        body: dict[str, Any] = {"generated_text": self.prefix + result.text}
        if self.p.details:
            tokens = result.tokens
            body["details"] = {
                "finish_reason": finish,
                "generated_tokens": len(tokens),
                "seed": self.seed,
                "prefill": [self.token(t, str(self.tok.decode([t], skip_special_tokens=False)), None)
                            for t in self.ids] if self.p.decoder_input_details else [],
                "tokens": [self.token(s.token_id, s.text, s.logprob) for s in tokens if s.token_id is not None],
                "top_tokens": [self.alternatives(s) for s in tokens] if self.p.top_n_tokens else None,
                "best_of_sequences": None,
            }
        return [body] if self.as_list else body


async def _respond(request: Request, *, stream: bool | None, as_list: bool = False) -> Response:
    """Parse, admit and answer; `stream` None: as the request's own `stream` field says (POST /)."""
    state = state_of(request)
    req = await parse(request, TgiRequest, state.body_limit)
    p = req.params()
    ids = prompt_ids(state, req.inputs, "inputs")
    if p.truncate is not None:
        ids = ids[-p.truncate :]  # TGI keeps the last `truncate` tokens
    # TGI keeps the stop sequence in the output and holds nothing back.
    gen = admit(state, [ids], [p.params()], p.stop or [], new_id("tgi"), hold_back=False)
    fmt = TgiFormat(state.tokenizer, p, ids, req.inputs if p.return_full_text else "", gen, as_list)
    if stream if stream is not None else req.stream:
        return stream_response(gen, fmt)
    return await whole_response(request, gen, fmt)


async def generate(request: Request) -> Response:
    return await _respond(request, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _respond(request, stream=True)


async def root(request: Request) -> Response:
    """POST / - what the text-generation client calls: a list of one response, or a stream."""
    return await _respond(request, stream=None, as_list=True)
