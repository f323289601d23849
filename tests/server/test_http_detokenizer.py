"""server.detokenizer: incremental detokenization over a byte-level BPE (multi-byte characters split
across tokens) and stop-string matching with hold-back."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from server.detokenizer import IncrementalDetokenizer
from server.stop_strings import StopMatcher

TEXTS = ["hello world", "Héllo wörld — naïve", "日本語のテキスト", "emoji 😀🚀✨ end", "a😀b日c", "the cat sat"]


def stream_decode(tokenizer: Any, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt or [])
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        pieces = stream_decode(tokenizer, ids)
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
    # the emoji really is split over several byte-level tokens, or the test proves nothing
    emoji_ids = tokenizer("😀🚀✨")["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in emoji_ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("ab é日😀🚀 \n")), min_size=1, max_size=30))
def test_incremental_equals_full_decode(tokenizer: Any, chars: list[str]) -> None:
    text = "".join(chars)
    ids = tokenizer(text)["input_ids"]
    assert "".join(stream_decode(tokenizer, ids)) == tokenizer.decode(ids)


def test_prompt_context_does_not_leak_into_output(tokenizer: Any) -> None:
    prompt = tokenizer("the cat")["input_ids"]
    gen = tokenizer(" sat on the mat")["input_ids"]
    assert "".join(stream_decode(tokenizer, gen, prompt)) == " sat on the mat"


def test_dangling_partial_character_is_flushed_as_replacement(tokenizer: Any) -> None:
    ids = tokenizer("😀")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert "\ufffd" in detok.flush()


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = tokenizer("hello")["input_ids"] + [tokenizer.eos_token_id] + tokenizer(" world")["input_ids"]
    assert "".join(stream_decode(tokenizer, ids)) == "hello world"


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
