"""Request models for /v1/completions and /v1/chat/completions.

Parameters this server cannot honour are rejected with a 400 naming them (never silently ignored);
`user` is the one documented no-op.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from server.errors import bad_param, unsupported
from server.limits import MAX_N, MaxTokens, TokenId, TopLogprobs, check_stops
from server.protocol import ChatMessage, SamplingKnobs, StrictModel

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class StreamOptions(StrictModel):
    include_usage: bool | None = False


class SamplingFields(SamplingKnobs):
    """What both OpenAI endpoints share beyond the sampling knobs (plus the vLLM extensions)."""

    model: str | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stops([value] if isinstance(value, str) else (value or []))
        return value

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not s:
                raise bad_param("stop", "stop strings must not be empty")
        return stops

    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "only allowed when stream is true")
        return bool(self.stream_options and self.stream_options.include_usage)

    def num_choices(self) -> int:
        return self.n or 1


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    logprobs: TopLogprobs | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of != self.num_choices():
            raise unsupported("best_of", "only best_of == n is supported")
        if self.suffix:
            raise unsupported("suffix")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.echo and self.logprobs is not None:
            raise unsupported("echo", "echo with logprobs needs prompt logprobs, which this server does not compute")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of text or token-id prompts; empty prompts are a 400."""
        p = self.prompt
        items: list[Any]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise bad_param("prompt", "must not be empty")
        for item in items:
            if len(item) == 0:
                raise bad_param("prompt", "must not be empty")
        return items


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    logit_bias: dict[str, float] | list[float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        if not self.messages:
            raise bad_param("messages", "must not be empty")
        if self.logit_bias:
            raise unsupported("logit_bias")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", "only {'type': 'text'}")
        if self.tools:
            raise unsupported("tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_param("top_logprobs", "requires logprobs to be true")

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
