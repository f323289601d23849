"""How OpenAI spells a generation: `CompletionFormat` (/v1/completions) and `ChatFormat`
(/v1/chat/completions), the `OutputFormat`s the shared output path (server.http.output) drives: chunk
envelopes, choices, logprobs, usage and the closing [DONE]."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from server.engine.interface import FinishReason, Tokenizer
from server.http.admission import Generation
from server.http.errors import ApiError
from server.http.output import sse
from server.http.runs import RunResult, TextDelta
from server.http.state import AppState

FINGERPRINT = "bucketserve"
DONE = b"data: [DONE]\n\n"


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return str(tok.decode([token_id], skip_special_tokens=False))


class OpenAIFormat:
    """What completions and chat share: ids, envelope, usage, error events; subclasses spell a choice."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, state: AppState, gen: Generation, prompt_tokens: int, include_usage: bool,
                 logprobs: bool, choices: int = 1) -> None:
        self.state, self.gen, self.tok = state, gen, state.tokenizer
        self.prompt_tokens = prompt_tokens
        self.choices = choices  # sequences per prompt: gen.handles holds each prompt's, one after another
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.generated = 0

    # -- what a subclass spells ------------------------------------------------------------------------
    def delta_choice(self, index: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, index: int, result: RunResult) -> dict[str, Any]:
        raise NotImplementedError

    def token_logprobs(self, index: int, deltas: Sequence[TextDelta]) -> dict[str, Any]:
        raise NotImplementedError

    # -- OutputFormat ----------------------------------------------------------------------------------
    def opening(self) -> Iterable[bytes]:
        return ()

    def event(self, index: int, delta: TextDelta) -> bytes | None:
        self.generated += delta.token_id is not None
        if delta.finish_reason is FinishReason.ERROR:
            return sse({"error": {"message": _failure(delta.error), "type": "server_error", "param": None,
                                  "code": "engine_error"}})
        lp = self.token_logprobs(index, [delta]) if self.logprobs and delta.token_id is not None else None
        choice = self.delta_choice(index, delta.text, lp, delta.finish_reason.openai if delta.finish_reason else None)
        return self.chunk(choice) if delta.text or delta.finish_reason or lp else None

    def closing(self) -> Iterable[bytes]:
        if self.include_usage:
            yield sse({**self.envelope([], stream=True), "usage": self.usage(self.generated)})
        yield DONE

    def body(self, results: list[RunResult]) -> dict[str, Any]:
        for r in results:
            if r.finish_reason is FinishReason.ERROR:
                raise ApiError(500, _failure(r.error), type="server_error", code="engine_error")
        choices = [self.final_choice(k, r) for k, r in enumerate(results)]
        return {**self.envelope(choices, stream=False), "usage": self.usage(sum(len(r.tokens) for r in results))}

    # -- framing ---------------------------------------------------------------------------------------
    def chunk(self, choice: dict[str, Any]) -> bytes:
        usage_field = {"usage": None} if self.include_usage else {}
        return sse({**self.envelope([choice], stream=True), **usage_field})

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens a prefix-cached slot already
        held, counted once per prompt as prompt_tokens counts them (the most any of its sequences reused)."""
        hs, n = self.gen.handles, max(1, self.choices)
        cached = sum(max(h.cached_tokens for h in hs[i : i + n]) for i in range(0, len(hs), n))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        return {"id": self.gen.id, "object": self.chunk_object if stream else self.object,
                "created": self.gen.created, "model": self.state.model_name, "system_fingerprint": FINGERPRINT,
                "choices": choices}


def _failure(error: str | None) -> str:
    return f"generation failed: {error or 'engine error'}"


class CompletionFormat(OpenAIFormat):
    def __init__(self, state: AppState, gen: Generation, prompt_tokens: int, include_usage: bool,
                 logprobs: bool, echoes: list[str], choices: int = 1) -> None:
        super().__init__(state, gen, prompt_tokens, include_usage, logprobs, choices)
        self.echoes = echoes
        self.offsets = [len(e) for e in echoes]  # text_offset of each choice's next token

    def opening(self) -> Iterable[bytes]:
        return [self.chunk(self.delta_choice(k, echo, None, None)) for k, echo in enumerate(self.echoes) if echo]

    def delta_choice(self, index: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def event(self, index: int, delta: TextDelta) -> bytes | None:
        out = super().event(index, delta)
        self.offsets[index] += len(delta.text)
        return out

    def final_choice(self, index: int, result: RunResult) -> dict[str, Any]:
        echo = self.echoes[index]
        lp = _completion_logprobs(self.tok, result.steps, len(echo)) if self.logprobs else None
        return self.delta_choice(index, echo + result.text, lp, result.finish_reason.openai)

    def token_logprobs(self, index: int, deltas: Sequence[TextDelta]) -> dict[str, Any]:
        return _completion_logprobs(self.tok, deltas, self.offsets[index])


def _completion_logprobs(tok: Tokenizer, deltas: Sequence[TextDelta], offset: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for s in deltas:
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


class ChatFormat(OpenAIFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self) -> Iterable[bytes]:
        return [self.chunk(self.delta_choice(k, "", None, None)) for k in range(len(self.gen.runs))]

    def delta_choice(self, index: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        # "role" in every delta: harmless for OpenAI clients, required by the text-generation client.
        delta = {"role": "assistant", "content": text, "tool_calls": None}
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    def final_choice(self, index: int, result: RunResult) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": result.text},
                "logprobs": self.token_logprobs(index, result.steps) if self.logprobs else None,
                "finish_reason": result.finish_reason.openai}

    def token_logprobs(self, index: int, deltas: Sequence[TextDelta]) -> dict[str, Any]:
        def entry(token_id: int, lp: float | None) -> dict[str, Any]:
            text = _token_text(self.tok, token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top_logprobs]}
                            for s in deltas if s.token_id is not None]}
