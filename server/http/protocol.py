"""Shared request plumbing: the strict pydantic base model, the sampling fields OpenAI and TGI share (and
their one mapping onto SamplingParams), the size-limited JSON body reader, and the small /tokenize and
/detokenize models. OpenAI and TGI models live in protocol_openai / protocol_tgi; their bounds in limits.

Policy: every request model forbids unknown fields (a 400 naming them), is strict about types (no
"1" for 1, no true for 1), and rejects non-finite floats (JSON `NaN` / `Infinity` / 1e999).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

from models.params import SamplingParams
from server.http.errors import ApiError, unsupported
from server.http.limits import (
    SEED_MAX,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    StopTokenIds,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

M = TypeVar("M", bound="StrictModel")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingKnobs(StrictModel):
    """The sampling fields OpenAI and TGI spell alike, and the one mapping onto SamplingParams."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop_token_ids: StopTokenIds | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = False

    def to_params(self, max_tokens: int, logprobs: int | None, *, greedy: bool = False,
                  index: int = 0) -> SamplingParams:
        """SamplingParams for choice `index` (seed, seed+1, ... so n choices differ but stay reproducible);
        `greedy` forces temperature 0 (TGI without do_sample or any sampling knob)."""
        seed = None if self.seed is None else (self.seed + index) % (SEED_MAX + 1)
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if greedy else temperature,
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


class ContentPart(StrictModel):
    """One part of a message's content list. A part of any type parses (image and audio parts carry fields of
    their own), so that a non-text part is refused as unsupported rather than as unknown fields; a text part's
    unknown fields are refused by name all the same (ChatMessage.as_template_dict)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: str = ""


class ChatMessage(StrictModel):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def as_template_dict(self, index: int) -> dict[str, Any]:
        """The plain dict a chat template expects for message `index`; text parts are joined, any other part
        or a text part's unknown field is a 400 naming it (messages.<index>.content.<i>...)."""
        where = f"messages.{index}"
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.type != "text":
                    raise unsupported(f"{where}.content.{i}.type", f"content part type {part.type!r}: text only")
                if part.model_extra:
                    field = f"{where}.content.{i}.{next(iter(part.model_extra))}"
                    raise ApiError(400, f"unknown field: {field}; this server rejects parameters it does not "
                                   "implement", param=field, code="unknown_parameter")
            content: str = "".join(p.text for p in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            raise unsupported(f"{where}.tool_calls")
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[TokenId]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not valid JSON")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes before buffering it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            too_big = int(declared) > limit
        except ValueError:
            raise ApiError(400, "invalid Content-Length header", code="invalid_request") from None
        if too_big:
            raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """Parse the body as one JSON object; malformed JSON, NaN/Infinity and non-objects are a 400."""
    raw = await read_body(request, limit)
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        # Decoded strictly here: json.loads(bytes) would decode with "surrogatepass", letting the UTF-8 bytes of a
        # lone surrogate (ED A0 80) through to the tokenizer and the error bodies, which cannot encode it.
        text = raw.decode(json.detect_encoding(raw))
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"request body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    if "\\u" in text:
        _reject_lone_surrogates(data)
    return data


def _reject_lone_surrogates(data: dict[str, Any]) -> None:
    """JSON may spell an unpaired UTF-16 surrogate ("\\ud800"); such a string can be neither tokenized nor
    sent back as UTF-8, so it is refused here, once, for every field."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        raise ApiError(400, "request body holds an unpaired UTF-16 surrogate (\\ud800-\\udfff escape)",
                       code="invalid_json") from None


async def parse(request: Request, model: type[M], limit: int) -> M:
    """Read, parse and validate a request body (pydantic errors become 400 via errors.to_api_error)."""
    return model.model_validate(await read_json(request, limit))
