"""What every route shares: the app state (engine, settings, metrics), prompt tokenization and token-id
checks."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from starlette.requests import Request

from buckets import PromptTooLongError
from server.config import ServerSettings
from server.engine.interface import EngineAPI, Tokenizer
from server.http.errors import ApiError, bad_param
from server.metrics.hooks import ServedMetrics
from server.metrics.safe_hooks import SafeHooks

log = logging.getLogger("bucketserve.http")
MODEL_ALIASES = ("tgi",)  # the text-generation client's chat() hard-codes model="tgi"


@dataclass
class AppState:
    engine: EngineAPI
    settings: ServerSettings
    metrics: ServedMetrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    hooks: SafeHooks = field(init=False)  # every hook call goes through here: a metrics bug never fails a request

    def __post_init__(self) -> None:
        self.hooks = SafeHooks(self.metrics)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def body_limit(self) -> int:
        return self.settings.max_body_bytes

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in MODEL_ALIASES:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           type="not_found_error", param="model", code="model_not_found")


def state_of(request: Request) -> AppState:
    state: AppState = request.app.state.bucketserve
    return state


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- tokenization -----------------------------------------------------------------------------------
def check_ids(state: AppState, ids: Sequence[int], param: str) -> None:
    """Token ids a client sent, against the engine's one vocabulary limit (ids the model can embed and
    the tokenizer can decode); the 400 names the parameter."""
    limit = state.engine.vocab_limit
    for t in ids:
        if not 0 <= t < limit:
            raise bad_param(param, f"token id {t} is outside the vocabulary [0, {limit})")


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
    return ids


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's own chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages",
                       code="no_chat_template")
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - templates raise anything (jinja's raise_exception included)
        raise ApiError(400, f"messages could not be rendered with the chat template: {exc}",
                       param="messages", code="invalid_messages") from None
    # transformers 5 returns a BatchEncoding (a mapping) by default; older versions a plain list.
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(t) for t in ids]


def prompt_ids(state: AppState, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        ids = encode_text(state.tokenizer, prompt)
    else:
        ids = list(prompt)
        check_ids(state, ids, param)
    if not ids:
        raise bad_param(param, "is empty after tokenization")
    return ids


def default_max_tokens(state: AppState, prompt_len: int) -> int:
    """All the room the context leaves (vLLM's chat default); a prompt that fills it is too long."""
    state.engine.table.length_for(prompt_len)  # a prompt over the largest bucket is reported as such
    room = state.engine.table.context_length - prompt_len
    if room < 1:
        raise PromptTooLongError(prompt_len + 1, state.engine.table.context_length, "prompt + max_tokens")
    return room
