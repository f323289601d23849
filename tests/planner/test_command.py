from __future__ import annotations

import argparse
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from buckets import BucketTable
from planner import command as plan_command
from planner.command import padding_report, read_lengths_file
from planner.inputs import PlanInputError, histogram_from_metrics, read_prompts_file


def run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    return plan_command.run(parser.parse_args(argv))


def write_lengths(path: Path) -> Path:
    # Two clusters and one over-limit prompt: the planner should put buckets at the cluster tops.
    lengths = [30] * 50 + [40] * 50 + [900] * 20 + [1000] * 10 + [5000]
    path.write_text("# recorded prompt lengths\n" + "\n".join(map(str, lengths)) + "\n\n")
    return path


def test_plan_from_lengths_file_writes_a_loadable_table_and_plots(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    current = tmp_path / "current.json"
    BucketTable((64, 256, 1024, 2048), batch_sizes=(1, 2, 4), prefill_batch_sizes=(1, 2), context_length=2048).save(
        current
    )
    out = tmp_path / "planned.json"
    rc = run_plan(["--lengths-file", str(write_lengths(tmp_path / "l.txt")), "--buckets-file", str(current),
                   "--max-graphs", "2", "--alpha", "0", "--out", str(out), "--plot-dir", str(tmp_path / "plots")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "over limit: 1 prompts longer than 2048" in text
    assert "current buckets:  64,256,1024,2048" in text
    assert "proposed buckets: 40,1000" in text
    assert "padding ratio" in text and "expected cost per prompt" in text
    assert "16 (12 decode + 4 prefill)" in text  # proposed: 3 batch x 4 KV decode + 2 lengths x 2 prefill rows

    table = BucketTable.load(out)
    assert table.lengths == (40, 1000)
    assert table.batch_sizes == (1, 2, 4) and table.prefill_batch_sizes == (1, 2)
    assert table.context_length == 2048
    for name in ("lengths.png", "padding_vs_buckets.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5000


def test_plan_fits_kv_buckets_to_prompt_plus_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "planned.json"
    rc = run_plan(["--lengths-file", str(write_lengths(tmp_path / "l.txt")), "--max-graphs", "2",
                   "--kv-buckets", "3", "--output-tokens", "24", "--out", str(out)])
    assert rc == 0
    assert "proposed KV buckets: 64,1024,2048" in capsys.readouterr().out  # 30/40 + 24 and 900/1000 + 24
    assert BucketTable.load(out).kv_lengths == (64, 1024, 2048)
    assert plan_command.plan_kv_buckets({100: 5}, 1, 10, 512) == (512,)  # one bucket: the context


def test_default_current_table_is_powers_of_two_and_k_matches(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "l.json"
    lengths.write_text(json.dumps([10, 100, 300, 1500, 1500]))
    assert run_plan(["--lengths-file", str(lengths), "--max-model-len", "2048", "--cover-model-limit"]) == 0
    text = capsys.readouterr().out
    assert "current buckets:  64,128,256,512,1024,2048" in text
    proposed = text.split("proposed buckets: ")[1].split()[0].split(",")
    assert proposed[-1] == "2048"  # --cover-model-limit
    assert len(proposed) <= 6


def test_compile_budget_caps_the_number_of_buckets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = write_lengths(tmp_path / "l.txt")
    # 100 s budget, 20 s per graph, 2 prefill batch sizes -> floor(100 / 40) = 2 length buckets
    rc = run_plan(["--lengths-file", str(lengths), "--prefill-batch-sizes", "1,2", "--max-graphs", "8",
                   "--compile-seconds-per-graph", "20", "--compile-budget", "100"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "at most 2 length buckets" in text
    assert len(text.split("proposed buckets: ")[1].split()[0].split(",")) == 2


def test_bad_inputs_fail_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(["--lengths-file", str(tmp_path / "missing.txt")]) == 2
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    assert run_plan(["--lengths-file", str(bad)]) == 2
    assert "bad.txt:2" in capsys.readouterr().err
    assert run_plan(["--prompts-file", str(bad)]) == 2
    assert "--model" in capsys.readouterr().err
    assert run_plan(["--lengths-file", str(write_lengths(tmp_path / "l.txt")), "--compile-budget", "5"]) == 2
    assert "go together" in capsys.readouterr().err


def test_read_lengths_file_formats(tmp_path: Path) -> None:
    p = tmp_path / "a.txt"
    p.write_text("5\n5  # comment\n7\n")
    assert read_lengths_file(p) == {5: 2, 7: 1}
    p.write_text("[3, 3, 9]")
    assert read_lengths_file(p) == {3: 2, 9: 1}


def test_padding_report_mentions_current_padding_and_a_better_plan() -> None:
    table = BucketTable((64, 128, 256), context_length=256)
    report = padding_report(table, [65] * 10 + [129] * 10 + [300])
    assert "21 recorded prompts" in report
    assert "buckets 64,128,256" in report
    assert "1 prompts are longer than the largest bucket 256" in report
    assert "planned buckets 65,129" in report


# -- Prometheus scrape --------------------------------------------------------------------------------
def metrics_text() -> str:
    registry = CollectorRegistry()
    hist = Histogram("bucketserve_prompt_length", "prompt tokens", ["model"], registry=registry,
                     buckets=(64, 128, 256, 512, 1024, 2048))
    for n in [10] * 30 + [100] * 20 + [500] * 5:
        hist.labels(model="a").observe(n)
    for n in [100] * 10 + [3000] * 2:
        hist.labels(model="b").observe(n)
    return generate_latest(registry).decode()


def test_histogram_from_metrics_puts_mass_at_edges() -> None:
    hist = histogram_from_metrics(metrics_text(), limit=2048)
    assert hist == {64: 30, 128: 30, 512: 5, 2049: 2}  # +Inf beyond the limit edge -> over limit
    assert histogram_from_metrics(metrics_text(), limit=4096)[4096] == 2  # +Inf below a larger limit
    with pytest.raises(PlanInputError, match="no histogram"):
        histogram_from_metrics(metrics_text(), limit=2048, metric="other")


@pytest.fixture
def metrics_url() -> Iterator[str]:
    body = metrics_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_plan_from_metrics_url(metrics_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "b.json"
    assert run_plan(["--metrics-url", metrics_url, "--max-graphs", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "65 prompts" in text
    assert "over limit: 2 prompts" in text
    assert BucketTable.load(out).lengths == (64, 128, 512)


# -- prompts file with a tiny local tokenizer ----------------------------------------------------------
def tiny_tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}"
    )
    fast.save_pretrained(str(path))
    return path


def test_plan_from_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_tokenizer_dir(tmp_path / "tok")
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "hello world hello"},  # 3 tokens
        {"prompt": ["hello", "hello world"]},  # 1 and 2 tokens
        {"prompt": [3, 4, 3, 4, 3]},  # 5 token ids
        {"messages": [{"role": "user", "content": "hello world"}]},  # <s> user hello world </s> <s> assistant: 7
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_prompts_file(prompts, str(model)) == {3: 1, 1: 1, 2: 1, 5: 1, 7: 1}
    out = tmp_path / "b.json"
    assert run_plan(["--prompts-file", str(prompts), "--model", str(model), "--max-graphs", "5", "--alpha", "0",
                     "--out", str(out)]) == 0
    assert BucketTable.load(out).lengths == (1, 2, 3, 5, 7)
    assert "5 prompts, 5 distinct lengths" in capsys.readouterr().out


@pytest.mark.parametrize("row, message", [
    ({"messages": "oops"}, "non-empty list of message objects"),
    ({"messages": []}, "non-empty list of message objects"),
    ({"messages": ["hi"]}, "non-empty list of message objects"),  # it used to be a TypeError's traceback
])
def test_bad_messages_in_a_prompts_file_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  row: dict[str, object], message: str) -> None:
    model = tiny_tokenizer_dir(tmp_path / "tok")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n" + json.dumps(row) + "\n")
    assert run_plan(["--prompts-file", str(prompts), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "p.jsonl:2" in err and message in err


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_a_context_length_that_is_not_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               limit: str) -> None:
    assert run_plan(["--lengths-file", str(write_lengths(tmp_path / "l.txt")), "--max-model-len", limit]) == 2
    assert "--max-model-len must be positive" in capsys.readouterr().err
