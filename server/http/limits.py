"""Every bound the HTTP layer puts on a request, defined once and shared by the OpenAI and TGI models.

The sampling bounds come from `models.params` (the record enforces them too); the rest bound the work one
request may ask of the event loop (stop strings are matched per token there) and of the queue.
"""

from __future__ import annotations

from typing import Annotated, Sequence

from pydantic import Field

from models.params import LOGPROBS_MAX, PENALTY_RANGE, TOP_K_MAX

MAX_N = 128  # choices per request (also capped by --max-waiting-requests)
MAX_STOPS = 16  # OpenAI itself allows 4
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
SEED_MAX = 2**63 - 1
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_MAX_NEW_TOKENS = 20  # the TGI client's own default
TGI_PATHS = ("/", "/generate", "/generate_stream")  # their errors also carry TGI's `error_type`

Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
TokenId = Annotated[int, Field(ge=0)]
MaxTokens = Annotated[int, Field(ge=1)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
RepetitionPenalty = Annotated[float, Field(gt=0)]  # the record's own range names the bounds (SamplingError)
TopK = Annotated[int, Field(ge=-1, le=TOP_K_MAX)]  # -1 or 0: off (vLLM spells it -1)
TgiTopK = Annotated[int, Field(ge=0, le=TOP_K_MAX)]  # TGI has no -1 spelling of "off"
TopLogprobs = Annotated[int, Field(ge=0, le=LOGPROBS_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


def check_stops(stops: Sequence[str]) -> None:
    """Bound the number and length of stop strings (ValueError: pydantic turns it into a 400 naming the field)."""
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    if any(len(stop) > MAX_STOP_LENGTH for stop in stops):
        raise ValueError(f"a stop sequence may have at most {MAX_STOP_LENGTH} characters")
