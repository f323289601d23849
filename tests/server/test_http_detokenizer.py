"""server.detokenizer: incremental detokenization over a byte-level BPE (multi-byte characters split
across tokens), through DecodeStream and through the fallback, and over a slow tokenizer; and
server.stop_strings: stop-string matching with hold-back."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.detokenizer import Detokenizer, IncrementalDetokenizer, StreamDetokenizer, incremental_detokenizer
from server.stop_strings import StopMatcher

TEXTS = ["hello world", "Héllo wörld — naïve", "日本語のテキスト", "emoji 😀🚀✨ end", "a😀b日c", "the cat sat"]
# fast: the tokenizers library's DecodeStream; fallback: the hand-written decoder on the same tokenizer;
# slow: a pure-Python tokenizer (ByT5, one token per byte), which always takes the fallback.
KINDS = ("fast", "fallback", "slow")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def pick(kind: str, tokenizer: Any, slow_tokenizer: Any) -> tuple[Any, Callable[..., Detokenizer]]:
    """(tokenizer, detokenizer factory) of one kind."""
    if kind == "fast":
        return tokenizer, lambda tok, prompt=(): StreamDetokenizer(tok.backend_tokenizer, prompt)
    if kind == "fallback":
        return tokenizer, IncrementalDetokenizer
    return slow_tokenizer, incremental_detokenizer


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def stream_decode(make: Callable[..., Detokenizer], tok: Any, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = make(tok, prompt or [])
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


def test_fast_tokenizers_use_decode_stream(tokenizer: Any, slow_tokenizer: Any) -> None:
    assert isinstance(incremental_detokenizer(tokenizer), StreamDetokenizer)
    assert isinstance(incremental_detokenizer(slow_tokenizer), IncrementalDetokenizer)


def test_multibyte_characters_are_never_split(kind: str, tokenizer: Any, slow_tokenizer: Any) -> None:
    tok, make = pick(kind, tokenizer, slow_tokenizer)
    for text in TEXTS:
        pieces = stream_decode(make, tok, encode(tok, text))
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
    # the emoji really is split over several tokens, or the test proves nothing
    assert len(encode(tok, "😀")) > 1


@pytest.mark.parametrize("which", KINDS)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("ab é日😀🚀 \n")), min_size=1, max_size=30))
def test_incremental_equals_full_decode(which: str, tokenizer: Any, slow_tokenizer: Any, chars: list[str]) -> None:
    tok, make = pick(which, tokenizer, slow_tokenizer)
    ids = encode(tok, "".join(chars))
    assert "".join(stream_decode(make, tok, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_prompt_context_does_not_leak_into_output(kind: str, tokenizer: Any, slow_tokenizer: Any) -> None:
    tok, make = pick(kind, tokenizer, slow_tokenizer)
    prompt = encode(tok, "the cat")
    gen = encode(tok, " sat on the mat")
    assert "".join(stream_decode(make, tok, gen, prompt)) == " sat on the mat"


def test_prompt_ending_inside_a_character_does_not_leak(tokenizer: Any) -> None:
    prompt = encode(tokenizer, "a😀")[:-1]  # the prompt ends with part of the emoji's bytes
    gen = encode(tokenizer, " the cat")
    assert "".join(stream_decode(incremental_detokenizer, tokenizer, gen, prompt)) == " the cat"


def test_dangling_partial_character_is_flushed_as_replacement(kind: str, tokenizer: Any, slow_tokenizer: Any) -> None:
    tok, make = pick(kind, tokenizer, slow_tokenizer)
    ids = encode(tok, "😀")
    detok = make(tok, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    # As a full decode would: U+FFFD for byte-level BPE; ByT5's decoder drops incomplete bytes instead.
    full = tok.decode(ids[:-1], skip_special_tokens=True)
    assert detok.flush() == full and ("\ufffd" in full) == (kind != "slow")


def test_special_tokens_are_skipped(kind: str, tokenizer: Any, slow_tokenizer: Any) -> None:
    tok, make = pick(kind, tokenizer, slow_tokenizer)
    ids = encode(tok, "hello") + [tok.eos_token_id] + encode(tok, " world")
    assert "".join(stream_decode(make, tok, ids)) == "hello world"


def run_stop(pieces: list[str], stops: list[str], hold_back: bool = True) -> tuple[list[str], bool, str]:
    m = StopMatcher(stops, hold_back=hold_back)
    out: list[str] = []
    matched = False
    for p in pieces:
        text, matched = m.feed(p)
        out.append(text)
        if matched:
            break
    if not matched:
        out.append(m.flush())
    return out, matched, m.text


def test_stop_string_split_across_pieces_is_held_back_then_cut() -> None:
    out, matched, text = run_stop(["Hello wo", "rld, ST", "O", "P here"], ["STOP"])
    assert matched and text == "Hello world, "
    assert "".join(out) == text
    assert out[1] == "rld, "  # "ST" withheld: it could start "STOP"


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    out, matched, text = run_stop(["abc ST", "ART"], ["STOP"])
    assert not matched and text == "abc START" and out == ["abc ", "START", ""]


def test_earliest_of_several_stops_wins() -> None:
    _, matched, text = run_stop(["one two three"], ["three", "two"])
    assert matched and text == "one "


def test_tgi_mode_keeps_the_stop_sequence_and_holds_nothing() -> None:
    out, matched, text = run_stop(["Hello wo", "rld, ST", "OP here"], ["STOP"], hold_back=False)
    assert matched and out == ["Hello wo", "rld, ST", "OP here"] and text == "Hello world, STOP here"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="abST😀", max_size=4), max_size=12),
    st.lists(st.text(alphabet="abST😀", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_streamed_equals_whole_and_cuts_at_first_stop(pieces: list[str], stops: list[str]) -> None:
    out, matched, text = run_stop(pieces, stops)
    whole = "".join(pieces)
    assert "".join(out) == text
    assert whole.startswith(text)
    assert not any(s in text for s in stops)  # nothing before the cut contains a stop string
    if matched:
        assert any(whole[len(text):].startswith(s) for s in stops)  # cut right before a stop string
    else:
        assert text == whole
