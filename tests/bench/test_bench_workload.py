from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench.workload import LengthDist, WorkloadError, WorkloadSpec, parse_length_dist, plan_requests, read_prompts_file


def test_parse_length_dist_forms() -> None:
    assert parse_length_dist("128") == LengthDist("fixed", 128.0)
    assert parse_length_dist("fixed:64") == LengthDist("fixed", 64.0)
    assert parse_length_dist("uniform:32..512") == LengthDist("uniform", 32.0, 512.0)
    assert parse_length_dist("uniform:32-512") == LengthDist("uniform", 32.0, 512.0)
    assert parse_length_dist("lognormal:median=128,sigma=0.6") == LengthDist("lognormal", 128.0, 0.6)
    assert parse_length_dist("lognormal:128,0.6") == LengthDist("lognormal", 128.0, 0.6)


@pytest.mark.parametrize("text", ["zipf:3", "fixed:0", "uniform:9..3", "lognormal:median=5", "fixed:abc"])
def test_parse_length_dist_errors_name_the_problem(text: str) -> None:
    with pytest.raises(WorkloadError):
        parse_length_dist(text)


def test_samples_stay_in_range() -> None:
    rng = random.Random(1)
    u = LengthDist("uniform", 10.0, 20.0)
    assert all(10 <= u.sample(rng) <= 20 for _ in range(200))
    ln = LengthDist("lognormal", 100.0, 0.5)
    samples = sorted(ln.sample(rng) for _ in range(2001))
    assert 80 <= samples[1000] <= 125  # the median of the draws sits near the configured median
    assert LengthDist("lognormal", 100.0, 0.0).sample(rng) == 100


def test_plan_is_seeded_and_capped() -> None:
    spec = WorkloadSpec(LengthDist("lognormal", 300.0, 1.0), LengthDist("fixed", 8.0), 50, seed=3, max_prompt_len=256)
    a, b = plan_requests(spec, 1000), plan_requests(spec, 1000)
    assert a == b
    assert len(a) == 50 and max(p.prompt_len for p in a) == 256
    assert all(p.output_len == 8 and 0 <= p.offset < 1000 for p in a)
    other = plan_requests(WorkloadSpec(spec.prompt_len, spec.output_len, 50, seed=4, max_prompt_len=256), 1000)
    assert other != a


def test_prompts_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps("plain text") + "\n\n" + json.dumps({"prompt": "hello", "max_tokens": 5}) + "\n")
    prompts = read_prompts_file(path)
    assert [(p.text, p.max_tokens) for p in prompts] == [("plain text", None), ("hello", 5)]
    spec = WorkloadSpec(LengthDist("fixed", 1.0), LengthDist("fixed", 9.0), 3, prompts_file=str(path))
    plans = plan_requests(spec, 100, prompts)
    assert [(p.source, p.output_len) for p in plans] == [(0, 9), (1, 5), (0, 9)]
    path.write_text('{"text": 3}\n')
    with pytest.raises(WorkloadError, match="p.jsonl:1"):
        read_prompts_file(path)
