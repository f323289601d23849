"""POST /v1/completions and POST /v1/chat/completions (OpenAI wire format, streaming and not).

Each route validates and tokenizes its request, admits it (server.http.admission) and hands the generation to
the shared output path (server.http.output) with its `OutputFormat`: `CompletionFormat` or `ChatFormat`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.http.admission import Generation, admit
from server.http.format_openai import ChatFormat, CompletionFormat
from server.http.limits import DEFAULT_COMPLETION_TOKENS
from server.http.output import stream_response, whole_response
from server.http.protocol import parse
from server.http.protocol_openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.http.state import AppState, default_max_tokens, new_id, prompt_ids, render_chat, state_of


def _admit(state: AppState, req: SamplingFields, kind: str, prompts: list[list[int]], max_tokens: int,
           logprobs: int | None) -> Generation:
    """n choices per prompt, seeded seed, seed+1, ... (reproducible, yet different)."""
    n = req.num_choices()
    params = [req.to_params(max_tokens, logprobs, index=j) for _ in prompts for j in range(n)]
    sequences = [p for p in prompts for _ in range(n)]
    return admit(state, sequences, params, req.stop_strings(), new_id(kind), many="n" if n > 1 else "prompt")


# -- routes -----------------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, CompletionRequest, state.body_limit)
    state.check_model(req.model)
    req.check_supported()
    raw_prompts = req.prompts()
    prompts = [prompt_ids(state, p) for p in raw_prompts]
    include_usage = req.include_usage()
    gen = _admit(state, req, "cmpl", prompts, req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
    try:
        echoes = [""] * len(gen.runs)
        if req.echo:
            texts = [p if isinstance(p, str) else str(state.tokenizer.decode(ids, skip_special_tokens=True))
                     for p, ids in zip(raw_prompts, prompts)]
            echoes = [t for t in texts for _ in range(req.num_choices())]
        fmt = CompletionFormat(state, gen, sum(len(p) for p in prompts), include_usage, req.logprobs is not None,
                               echoes, req.num_choices())
    except BaseException:
        gen.abort_all()  # admitted but never to be read: free its slots now
        raise
    return stream_response(gen, fmt) if req.stream else await whole_response(request, gen, fmt)


async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    req = await parse(request, ChatCompletionRequest, state.body_limit)
    state.check_model(req.model)
    req.check_supported()
    ids = render_chat(state.tokenizer, [m.as_template_dict(i) for i, m in enumerate(req.messages)])
    max_tokens = req.max_new_tokens() or default_max_tokens(state, len(ids))
    include_usage = req.include_usage()
    gen = _admit(state, req, "chatcmpl", [ids], max_tokens, req.logprobs_k())
    fmt = ChatFormat(state, gen, len(ids), include_usage, bool(req.logprobs), req.num_choices())
    return stream_response(gen, fmt) if req.stream else await whole_response(request, gen, fmt)
