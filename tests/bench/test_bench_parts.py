"""Request bodies, failure classification, /metrics parsing and exact-length prompts."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.client import ApiMode, build_body, classify_exception, next_pow2
from bench.prompts import Prompt, build_prompts, exact_prompt, load_corpus, rotate
from bench.scrape import delta, metric_total, parse_prometheus, snapshot
from bench.workload import RequestPlan


def test_next_pow2() -> None:
    assert [next_pow2(n) for n in (1, 2, 3, 64, 65, 1000)] == [1, 2, 4, 64, 128, 1024]


def test_classify_exception() -> None:
    req = httpx.Request("POST", "http://x")
    assert classify_exception(httpx.ReadTimeout("t", request=req)) == "timeout"
    assert classify_exception(httpx.ConnectTimeout("t", request=req)) == "timeout"
    assert classify_exception(httpx.ConnectError("refused", request=req)) == "connection_error"
    assert classify_exception(httpx.RemoteProtocolError("eof", request=req)) == "connection_error"
    assert classify_exception(httpx.ReadError("reset", request=req)) == "connection_error"
    assert classify_exception(httpx.DecodingError("bad", request=req)) == "protocol_error"


def test_build_body_modes() -> None:
    p = Prompt(0, "some text", (5, 6, 7), 12, 3)
    ids = build_body(p, ApiMode(model="m"))
    assert ids["prompt"] == [5, 6, 7] and ids["ignore_eos"] is True and ids["max_tokens"] == 12
    assert ids["stream"] is True and ids["stream_options"] == {"include_usage": True} and ids["model"] == "m"
    text = build_body(p, ApiMode(prompt_format="text", eos="generation_config"))
    assert text["prompt"] == "some text" and "ignore_eos" not in text and "model" not in text
    assert json.loads(text["generation_config"]) == {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    chat = build_body(p, ApiMode(endpoint="chat", prompt_format="text", eos="none"))
    assert chat["messages"] == [{"role": "user", "content": "some text"}] and "prompt" not in chat
    with pytest.raises(ValueError, match="chat"):
        ApiMode(endpoint="chat", prompt_format="ids")
    with pytest.raises(ValueError, match="eos"):
        ApiMode(eos="sometimes")


METRICS = """# HELP bucketserve_recompilations_total after ready
# TYPE bucketserve_recompilations_total counter
bucketserve_recompilations_total{reason="unwarmed_shape"} 2.0
bucketserve_recompilations_total{reason="guard_failure"} 1.0
bucketserve_warmup_seconds 12.5
bucketserve_graph_compilations_total{graph="prefill",bucket="b1_l64",phase="serving"} 1.0
bucketserve_graph_compilations_total{graph="decode",bucket="b1_kv2048",phase="warmup"} 4.0
weird_label{msg="a \\"quoted\\", comma"} 3 1700000000
"""


def test_parse_prometheus_and_totals() -> None:
    samples = parse_prometheus(METRICS)
    assert metric_total(samples, "bucketserve_recompilations_total") == 3.0
    assert metric_total(samples, "bucketserve_recompilations_total", reason="guard_failure") == 1.0
    assert metric_total(samples, "bucketserve_graph_compilations_total", phase="serving") == 1.0
    assert metric_total(samples, "missing_metric") is None
    weird = [s for s in samples if s.name == "weird_label"][0]
    assert weird.label("msg") == 'a "quoted", comma' and weird.value == 3.0
    snap = snapshot(samples)
    assert snap.is_bucketserve and snap.warmup_seconds == 12.5 and snap.recompilations == 3.0
    assert not snapshot(None).available
    assert delta(3.0, 5.0) == 2.0 and delta(None, 1.0) == 1.0 and delta(1.0, None) is None


class WordTokenizer:
    """One token per whitespace-separated word, like the fake server's /tokenize."""

    name = "words"

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def test_exact_prompt_hits_the_length_even_past_the_corpus_end() -> None:
    corpus = load_corpus()
    tok = WordTokenizer()
    for n in (1, 17, 200, len(corpus.split()) + 50):  # the last one wraps the corpus
        text, ids = exact_prompt(tok, rotate(corpus, 0), n)
        assert len(ids) == n and len(tok.encode(text)) == n
        assert text.split()[0] == corpus.split()[0]


def test_rotate_starts_on_a_word_boundary() -> None:
    corpus = "alpha beta gamma delta"
    assert rotate(corpus, 0) == corpus
    assert rotate(corpus, 2).startswith("beta ")
    assert sorted(rotate(corpus, 13).split()) == sorted(corpus.split())


def test_build_prompts_lengths_and_offsets() -> None:
    corpus = load_corpus()
    plans = [RequestPlan(0, 10, 4, 0), RequestPlan(1, 10, 5, 500), RequestPlan(2, 33, 6, 900)]
    prompts = build_prompts(plans, WordTokenizer(), corpus)
    assert [len(p.ids) for p in prompts] == [10, 10, 33]
    assert [p.output_len for p in prompts] == [4, 5, 6]
    assert prompts[0].text != prompts[1].text  # different offsets: no shared prefix
    assert all(p.text_tokens == len(p.ids) for p in prompts)


def test_a_server_that_is_down_is_named_as_such() -> None:
    """Without /tokenize the bench asks for --tokenizer; a server that does not answer at all is told apart (it
    used to get the same advice)."""
    import argparse

    from bench.cli import _tokenizer
    from bench.prompts import TokenizerError

    with pytest.raises(TokenizerError, match="cannot reach http://127.0.0.1:9"):
        _tokenizer("http://127.0.0.1:9", argparse.Namespace(tokenizer=None), {}, None)
