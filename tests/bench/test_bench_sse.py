from __future__ import annotations

import json

from bench.sse import SSEDecoder, interpret


def _chunk(text: str, finish: str | None = None, **extra: object) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}], **extra})


def test_decoder_reassembles_events_split_anywhere() -> None:
    stream = f"data: {_chunk(' a')}\n\n: keep-alive\n\ndata: {_chunk(' b')}\r\n\r\nevent: x\ndata: [DONE]\n\n"
    for step in (1, 3, 7, len(stream)):
        dec = SSEDecoder()
        out: list[str] = []
        for i in range(0, len(stream), step):
            out += dec.feed(stream[i : i + step])
        out += dec.close()
        assert out == [_chunk(" a"), _chunk(" b"), "[DONE]"], step


def test_decoder_joins_multiline_data_and_flushes_unterminated_event() -> None:
    dec = SSEDecoder()
    assert dec.feed("data: line1\ndata:line2\n\ndata: tail") == ["line1\nline2"]
    assert dec.close() == ["tail"]


def test_token_counting_rules_for_completions() -> None:
    assert interpret(_chunk(" hi")).tokens == 1
    assert interpret(_chunk("")).tokens == 1  # held-back bytes: still one generated token
    final_empty = interpret(_chunk("", "length"))
    assert final_empty.tokens == 0 and final_empty.finish_reason == "length"
    assert interpret(_chunk("!", "stop")).tokens == 1
    usage = interpret(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}))
    assert (usage.tokens, usage.completion_tokens, usage.prompt_tokens) == (0, 7, 5)
    assert interpret("[DONE]").done


def test_token_counting_rules_for_chat() -> None:
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    content = json.dumps({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    assert interpret(role).tokens == 0
    assert interpret(content).tokens == 1 and interpret(content).text == "Hi"


def test_errors_inside_the_stream() -> None:
    assert interpret(json.dumps({"error": {"message": "boom"}})).error == "boom"
    assert interpret('{"error": "plain"}').error == "plain"
    assert interpret("not json").error is not None
    assert interpret("[1, 2]").error is not None
