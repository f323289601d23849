"""Hugging Face text-generation-inference routes: POST /generate, POST /generate_stream and POST /
(which the `text-generation` client uses for both, switching on `stream`; non-streaming it answers
a one-element list). JSON shapes follow text_generation.types (Response, StreamResponse, Details, Token);
`TgiFormat` spells them for the shared output path (server.http.output).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from server.http.admission import admit
from server.http.format_tgi import TgiFormat
from server.http.output import stream_response, whole_response
from server.http.protocol import parse
from server.http.protocol_tgi import TgiRequest
from server.http.state import new_id, prompt_ids, state_of


async def _respond(request: Request, *, stream: bool | None, as_list: bool = False) -> Response:
    """Parse, admit and answer; `stream` None: as the request's own `stream` field says (POST /)."""
    state = state_of(request)
    req = await parse(request, TgiRequest, state.body_limit)
    p = req.params()
    ids = prompt_ids(state, req.inputs, "inputs")
    if p.truncate is not None:
        ids = ids[-p.truncate :]  # TGI keeps the last `truncate` tokens
    # TGI keeps the stop sequence in the output and holds nothing back.
    gen = admit(state, [ids], [p.params()], p.stop or [], new_id("tgi"), hold_back=False)
    fmt = TgiFormat(state.tokenizer, p, ids, req.inputs if p.return_full_text else "", gen, as_list)
    if stream if stream is not None else req.stream:
        return stream_response(gen, fmt)
    return await whole_response(request, gen, fmt)


async def generate(request: Request) -> Response:
    return await _respond(request, stream=False)


async def generate_stream(request: Request) -> Response:
    return await _respond(request, stream=True)


async def root(request: Request) -> Response:
    """POST / - what the text-generation client calls: a list of one response, or a stream."""
    return await _respond(request, stream=None, as_list=True)
