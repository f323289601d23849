"""Request models for /v1/completions and /v1/chat/completions, and their mapping onto SamplingParams.

Parameters this server cannot honour are rejected with a 400 naming them (never silently ignored);
`user` is the one documented no-op.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from models.sampling import SamplingParams
from server.errors import bad_param, unsupported
from server.protocol import SEED_MAX, ChatMessage, Seed, StrictModel, TokenId

LOGPROBS_MAX = 20  # SamplingParams' own bound; keeps the top-k gather small

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class StreamOptions(StrictModel):
    include_usage: bool | None = False


MAX_N = 128
MAX_STOPS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64


class SamplingFields(StrictModel):
    """Sampling parameters shared by both OpenAI endpoints (plus the vLLM extensions)."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1 or 0: off (vLLM uses -1)
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        # Stop strings are matched per token on the event loop: bound their number and length
        # (OpenAI itself allows 4).
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(stop) > MAX_STOP_LENGTH for stop in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_LENGTH} characters")
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

    def to_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        """SamplingParams for choice `index` (seed, seed+1, ... so n choices differ but stay reproducible)."""
        seed = None if self.seed is None else (self.seed + index) % (SEED_MAX + 1)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            seed=seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
        )


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=LOGPROBS_MAX)] | None = None
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
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=LOGPROBS_MAX)] | None = None
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
