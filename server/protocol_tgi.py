"""Request models for Hugging Face text-generation-inference routes (POST /, /generate, /generate_stream).

Field names and defaults follow `text_generation.types.Parameters` (client v0.7.0), which sends every
field, nulls included; the features bucketserve lacks (typical_p, watermark, grammar, best_of > 1,
adapters) are accepted only at their neutral value and otherwise rejected with a 400 naming them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from models.sampling import SamplingParams
from server.errors import bad_param, unsupported
from server.protocol import Seed, StrictModel
from server.protocol_openai import LOGPROBS_MAX

DEFAULT_MAX_NEW_TOKENS = 20  # the TGI client's own default


class TgiParameters(StrictModel):
    do_sample: bool | None = False
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    return_full_text: bool | None = False
    stop: Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)] | None = None
    seed: Seed | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    truncate: Annotated[int, Field(ge=1)] | None = None
    typical_p: Annotated[float, Field(gt=0, le=1)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    watermark: bool | None = False
    details: bool | None = False
    decoder_input_details: bool | None = False
    top_n_tokens: Annotated[int, Field(ge=0, le=LOGPROBS_MAX)] | None = None
    grammar: dict[str, Any] | None = None
    adapter_id: str | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = False

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

    def to_params(self) -> SamplingParams:
        sample = self.sampling()
        wants_logprobs = self.details or self.top_n_tokens
        return SamplingParams(
            max_tokens=self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            temperature=(1.0 if self.temperature is None else self.temperature) if sample else 0.0,
            top_p=self.top_p or 1.0,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=(self.top_n_tokens or 0) if wants_logprobs else None,
        )


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
