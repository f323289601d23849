"""Where `bucketserve plan` gets prompt lengths: a lengths file, a JSONL prompts file tokenized with the
model's tokenizer, or the prompt-length histogram scraped from a running server's /metrics."""

from __future__ import annotations

import json
import math
import urllib.request
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from buckets import BucketError
from buckets.planner import to_histogram

DEFAULT_METRIC = "bucketserve_prompt_length"


class PlanInputError(ValueError):
    """An input file or scrape could not be turned into prompt lengths; the message says where."""


def read_lengths_file(path: str | Path) -> dict[int, int]:
    """One integer per line (blank lines and `#` comments skipped), or a JSON list of integers."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanInputError(f"{path}: not a valid JSON list ({exc})") from exc
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise PlanInputError(f"{path}: the JSON list must hold integers only")
        lengths: list[int] = values
    else:
        lengths = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                lengths.append(int(line))
            except ValueError as exc:
                raise PlanInputError(f"{path}:{lineno}: expected an integer length, got {line!r}") from exc
    try:
        return to_histogram(lengths)
    except BucketError as exc:
        raise PlanInputError(f"{path}: {exc}") from exc


def _token_count(ids: Any) -> int:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); older ones a list.
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return len(ids)


def read_prompts_file(path: str | Path, model_dir: str) -> dict[int, int]:
    """JSONL of {"prompt": str | [str] | [int]} or {"messages": [...]}, tokenized like the server does:
    plain prompts with the tokenizer's special tokens, chats through the chat template with the
    generation prompt appended."""
    from transformers import AutoTokenizer  # heavy import, only for this input

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    counts: Counter[int] = Counter()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PlanInputError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise PlanInputError(f"{where}: expected an object with 'prompt' or 'messages'")
        if "messages" in row:
            messages = row["messages"]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise PlanInputError(f"{where}: 'messages' must be a non-empty list of message objects")
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except Exception as exc:  # noqa: BLE001 - the template's own errors (jinja, missing keys) are input errors
                raise PlanInputError(f"{where}: the chat template failed on these messages: {exc}") from exc
            counts[_token_count(ids)] += 1
            continue
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompts = [prompt]  # already token ids
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            prompts = prompt  # a batch of prompts in one completions request
        else:
            raise PlanInputError(f"{where}: needs 'prompt' (string, list of strings or token ids) or 'messages'")
        for p in prompts:
            counts[len(p) if isinstance(p, list) else _token_count(tokenizer(p))] += 1
    counts.pop(0, None)  # an empty prompt is rejected by the server; it has no bucket
    return dict(counts)


def histogram_from_metrics(text: str, limit: int, metric: str = DEFAULT_METRIC) -> dict[int, int]:
    """Lengths from a Prometheus histogram. The prompts counted in bucket `le` lie in (previous edge,
    le]; all of them are taken to have length `le` (conservative: never shorter than they were). The
    +Inf bucket is put at the limit when the largest finite edge is below it, else past the limit."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[float, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != metric or family.type != "histogram":
            continue
        found = True
        for sample in family.samples:  # summed over label sets: cumulative counts add up
            if sample.name == metric + "_bucket":
                le = float(sample.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + sample.value
    if not found:
        raise PlanInputError(f"no histogram named {metric!r} in the metrics text")
    hist: Counter[int] = Counter()
    below = 0.0
    finite = [e for e in sorted(cumulative) if math.isfinite(e)]
    for edge in sorted(cumulative):
        mass = round(cumulative[edge] - below)
        below = cumulative[edge]
        if mass <= 0:
            continue
        if math.isfinite(edge):
            hist[max(1, math.ceil(edge))] += mass
        else:
            top = max(1, math.ceil(finite[-1])) if finite else limit
            hist[limit if top < limit else top + 1] += mass
    return dict(hist)


def scrape_metrics(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - the operator's own URL
        body: bytes = resp.read()
    return body.decode("utf-8")
