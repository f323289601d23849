"""How text-generation-inference spells a generation (text_generation.types: Response, StreamResponse,
Details, Token): `TgiFormat`, the `OutputFormat` the shared output path (server.http.output) drives."""

from __future__ import annotations

from typing import Any, Iterable

from server.engine.interface import FinishReason, Tokenizer
from server.http.admission import Generation
from server.http.errors import ApiError
from server.http.output import sse
from server.http.protocol_tgi import TgiParameters
from server.http.runs import RunResult, TextDelta

ABORTED = "the request was aborted by the server before it finished"


class TgiFormat:
    def __init__(self, tokenizer: Tokenizer, p: TgiParameters, ids: list[int], prefix: str, gen: Generation,
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
