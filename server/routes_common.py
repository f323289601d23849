"""What every generation route shares: the app state, the error-catching endpoint wrapper, prompt
tokenization and validation, submission of one or many sequences, and the bucket headers."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from buckets import PromptTooLongError
from models.sampling import SamplingParams
from server.config import ServerSettings
from server.engine import DrainingError, EngineNotReadyError, QueueFullError
from server.errors import ApiError, bad_param, error_response, to_api_error

if TYPE_CHECKING:
    from server.engine import Engine, RequestHandle
    from server.metrics import Metrics

log = logging.getLogger("bucketserve.http")
Endpoint = Callable[[Request], Awaitable[Response]]
TGI_PATHS = ("/", "/generate", "/generate_stream")
MODEL_ALIASES = ("tgi",)  # the text-generation client's chat() hard-codes model="tgi"


@dataclass
class AppState:
    engine: Engine
    settings: ServerSettings
    metrics: Metrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self) -> Any:
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


def endpoint(fn: Endpoint) -> Endpoint:
    """Every exception inside one request becomes that request's error response (never a crash)."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as exc:  # noqa: BLE001 - the catch-all is the point: one request, one error
            return error_response(to_api_error(exc), tgi=request.url.path in TGI_PATHS)

    return wrapper


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- tokenization -----------------------------------------------------------------------------------
def vocab_size(tokenizer: Any) -> int:
    return int(len(tokenizer))


def check_ids(tokenizer: Any, ids: Sequence[int], param: str) -> None:
    limit = vocab_size(tokenizer)
    for t in ids:
        if not 0 <= t < limit:
            raise bad_param(param, f"token id {t} is outside the vocabulary [0, {limit})")


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = [int(t) for t in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]
    return ids


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
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


def prompt_ids(tokenizer: Any, prompt: str | list[int], param: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt)
    else:
        ids = list(prompt)
        check_ids(tokenizer, ids, param)
    if not ids:
        raise bad_param(param, "is empty after tokenization")
    return ids


# -- submission -------------------------------------------------------------------------------------
def default_max_tokens(state: AppState, prompt_len: int) -> int:
    """All the room the context leaves (vLLM's chat default); a prompt that fills it is too long."""
    state.engine.table.length_for(prompt_len)  # a prompt over the largest bucket is reported as such
    room = state.engine.table.context_length - prompt_len
    if room < 1:
        raise PromptTooLongError(prompt_len + 1, state.engine.table.context_length, "prompt + max_tokens")
    return room


def submit_all(
    state: AppState, prompts: Sequence[list[int]], params: Sequence[SamplingParams], request_id: str
) -> list[RequestHandle]:
    """Submit one sequence per (prompt, params); all or nothing: on any refusal the ones already
    admitted are aborted and the error propagates (mapped by errors.ERROR_TABLE)."""
    limit = state.settings.max_waiting_requests
    if len(prompts) > limit:
        raise bad_param("n", f"this request asks for {len(prompts)} sequences; the limit is {limit}")
    table = state.engine.table
    try:
        for ids, p in zip(prompts, params):  # check everything before anything is queued
            check_ids(state.tokenizer, p.stop_token_ids, "stop_token_ids")
            table.check_request(len(ids), p.max_tokens)
    except PromptTooLongError:
        count(state.metrics.request_over_limit)
        raise
    handles: list[RequestHandle] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            handles.append(state.engine.submit(ids, p, request_id=f"{request_id}-{i}"))
    except BaseException as exc:
        for h in handles:
            h.abort("client")
        _count_rejection(state, exc)
        raise
    for h in handles:
        count(state.metrics.request_admitted, h.bucket, h.prompt_tokens)
    return handles


def count(hook: Callable[..., None], *args: Any) -> None:
    """Call a metrics hook; a metrics bug is logged, never turned into a failed (and leaked) request."""
    try:
        hook(*args)
    except Exception:  # noqa: BLE001
        log.exception("metrics hook %s failed", getattr(hook, "__name__", hook))


def _count_rejection(state: AppState, exc: BaseException) -> None:
    m = state.metrics
    if isinstance(exc, PromptTooLongError):
        count(m.request_over_limit)
    elif isinstance(exc, QueueFullError):
        count(m.request_rejected, "queue_full")
    elif isinstance(exc, EngineNotReadyError):
        count(m.request_rejected, "not_ready")
    elif isinstance(exc, DrainingError):
        count(m.request_rejected, "draining")


def bucket_headers(handles: Sequence[RequestHandle]) -> dict[str, str]:
    """x-bucket: the largest length bucket any sequence used; x-padded-tokens: pad tokens summed over
    every sequence of the request (see docs/http.md)."""
    return {
        "x-bucket": str(max(h.bucket for h in handles)),
        "x-padded-tokens": str(sum(h.padded_tokens for h in handles)),
    }
