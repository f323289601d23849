"""Request models for Hugging Face text-generation-inference routes (POST /, /generate, /generate_stream).

Field names and defaults follow `text_generation.types.Parameters` (client v0.7.0), which sends every
field, nulls included; the features bucketserve lacks (typical_p, watermark, grammar, best_of > 1,
adapters) are accepted only at their neutral value and otherwise rejected with a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from models.params import SamplingParams
from server.http.errors import bad_param, unsupported
from server.http.limits import DEFAULT_MAX_NEW_TOKENS, MaxTokens, TgiTopK, TokenId, TopLogprobs, check_stops
from server.http.protocol import SamplingKnobs, StrictModel


class TgiParameters(SamplingKnobs):
    top_k: TgiTopK | None = None
    stop_token_ids: list[TokenId] | None = None  # a bucketserve extension, unbounded as it always was
    do_sample: bool | None = False
    max_new_tokens: MaxTokens | None = None
    return_full_text: bool | None = False
    stop: list[str] | None = None
    truncate: Annotated[int, Field(ge=1)] | None = None
    typical_p: Annotated[float, Field(gt=0, le=1)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    watermark: bool | None = False
    details: bool | None = False
    decoder_input_details: bool | None = False
    top_n_tokens: TopLogprobs | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: list[str] | None) -> list[str] | None:
        check_stops(value or [])
        return value

    def check_supported(self) -> None:
        if self.typical_p is not None and self.typical_p != 1.0:
            raise unsupported("parameters.typical_p")
        if self.best_of not in (None, 1):
            raise unsupported("parameters.best_of", "only best_of 1")
        if self.watermark:
            raise unsupported("parameters.watermark")
        if self.grammar is not None:
            raise unsupported("parameters.grammar")
        if self.adapter_id:
            raise unsupported("parameters.adapter_id")
        for s in self.stop or []:
            if not s:
                raise bad_param("parameters.stop", "stop sequences must not be empty")

    def sampling(self) -> bool:
        """TGI samples when do_sample is set or any sampling knob is given; otherwise it is greedy."""
        knobs = (self.temperature, self.top_k, self.top_p, self.min_p)
        return bool(self.do_sample) or any(k is not None for k in knobs)

    def params(self) -> SamplingParams:
        wants_logprobs = self.details or self.top_n_tokens
        return self.to_params(self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
                              (self.top_n_tokens or 0) if wants_logprobs else None, greedy=not self.sampling())


class TgiRequest(StrictModel):
    inputs: str
    parameters: TgiParameters | None = None
    stream: bool | None = False

    def params(self) -> TgiParameters:
        if not self.inputs:
            raise bad_param("inputs", "must not be empty")
        p = self.parameters or TgiParameters()
        p.check_supported()
        return p
