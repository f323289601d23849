"""Helpers for the end-to-end /metrics tests: a live uvicorn server over the real engine (built the way
`bucketserve serve` builds it), a parsed /metrics scrape, and OpenAI requests that return their usage."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

from buckets import BucketTable, GraphKey
from server.compose import build_engine
from server.config import ServerSettings
from server.engine.engine import Engine
from server.http.app import create_app
from server.metrics.config import COMPILE_PHASES
from server.metrics.prometheus import Metrics
from tests.server.conftest import LiveServer, wait_ready

Labels = tuple[tuple[str, str], ...]
NO_EOS = {"ignore_eos": True}  # vLLM extension: generation runs to max_tokens, so counts are exact


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    samples: dict[tuple[str, Labels], float]


@dataclass(frozen=True)
class Scrape:
    """One parsed /metrics body: sample values by (sample name, sorted labels); *_created samples dropped."""

    samples: dict[tuple[str, Labels], float]
    families: dict[str, Family] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples: dict[tuple[str, Labels], float] = {}
        families: dict[str, Family] = {}
        for fam in text_string_to_metric_families(text):
            own: dict[tuple[str, Labels], float] = {}
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue  # creation timestamps: present unless disable_created_metrics() ran
                key = (s.name, tuple(sorted(s.labels.items())))
                assert key not in samples, f"duplicate sample {key}"
                own[key] = samples[key] = float(s.value)
            families[fam.name] = Family(fam.name, fam.type, own)
        return cls(samples, families)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def get(self, name: str, **labels: str) -> float:
        """The one sample with exactly these labels; KeyError if the series is missing."""
        key = (name, tuple(sorted(labels.items())))
        if key not in self.samples:
            have = [dict(lb) for n, lb in self.samples if n == name]
            raise KeyError(f"no series {name}{labels}; the scrape has {have}")
        return self.samples[key]

    def series(self, name: str) -> dict[Labels, float]:
        return {lb: v for (n, lb), v in self.samples.items() if n == name}

    def total(self, name: str, **labels: str) -> float:
        """Sum over every series of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for lb, v in self.series(name).items() if want <= set(lb))


def scrape(url: str) -> Scrape:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers["content-type"]
    return Scrape.parse(r.text)


def changed(before: Scrape, after: Scrape, name: str) -> dict[Labels, float]:
    """Series of `name` whose value changed between two scrapes, with their increase."""
    out = {}
    for lb, v in after.series(name).items():
        d = v - before.samples.get((name, lb), 0.0)
        if d:
            out[lb] = d
    return out


def eventually(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def assert_warmed_exactly(s: Scrape, table: BucketTable, warmed: list[GraphKey]) -> None:
    """graph_compilations_total: one series per (graph key, phase), warm-up compiled exactly `warmed`."""
    series = s.series("bucketserve_graph_compilations_total")
    want = {(("bucket", k.bucket), ("graph", k.phase), ("phase", ph)) for k in table.graph_keys()
            for ph in COMPILE_PHASES}
    assert set(series) == want
    for k in table.graph_keys():
        assert s.get("bucketserve_graph_compilations_total", graph=k.phase, bucket=k.bucket,
                     phase="warmup") == (1 if k in warmed else 0), k
    assert s.total("bucketserve_graph_compilations_total", phase="warmup") == len(warmed)
    assert s.get("bucketserve_graphs_ready") == len(warmed)
    assert s.get("bucketserve_ready") == 1
    assert s.get("bucketserve_warmup_seconds") > 0
    # dynamo-eager reports nothing about a compile cache: neither hits nor misses
    assert s.get("bucketserve_compile_cache_hits_total") == s.get("bucketserve_compile_cache_misses_total") == 0


@dataclass
class Served:
    server: LiveServer
    engine: Engine
    metrics: Metrics

    @property
    def url(self) -> str:
        return self.server.url

    def scrape(self) -> Scrape:
        return scrape(self.url)


@contextmanager
def serve(settings: ServerSettings, warm_keys: list[GraphKey] | None = None) -> Iterator[Served]:
    """The real server wiring (build_engine + create_app) on 127.0.0.1; `warm_keys` warms only those graphs
    (the rest compile on first use, or are refused, as the recompile policy says)."""
    engine, metrics = build_engine(settings)
    if warm_keys is not None:
        model = engine.model
        original = model.load_and_warm

        def load_and_warm_subset(keys: list[GraphKey] | None = None) -> None:
            original(list(warm_keys))

        model.load_and_warm = load_and_warm_subset  # type: ignore[method-assign]
    with LiveServer(create_app(engine, settings, metrics)) as server:
        wait_ready(engine.is_ready, timeout=120)
        yield Served(server, engine, metrics)


@dataclass(frozen=True)
class Outcome:
    """What one generation request reported: status, usage and the bucket headers."""

    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bucket: int = 0
    padded: int = 0
    body: Any = None


def _sse_events(lines: Iterator[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def generate(url: str, route: str, body: dict[str, Any]) -> Outcome:
    """POST one OpenAI request (streaming when body["stream"]); streaming asks for the usage chunk."""
    body = {"temperature": 0, **NO_EOS, **body}
    with httpx.Client(base_url=url, timeout=60) as client:
        if not body.get("stream"):
            r = client.post(route, json=body)
            if r.status_code != 200:
                return Outcome(r.status_code, body=r.json())
            usage = r.json()["usage"]
            headers, payload = r.headers, r.json()
        else:
            body["stream_options"] = {"include_usage": True}
            with client.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Outcome(r.status_code, body=r.json())
                events = _sse_events(r.iter_lines())
                headers = r.headers
            errors = [e["error"] for e in events if "error" in e]
            assert not errors, errors
            usage = events[-1]["usage"]
            payload = events
    return Outcome(200, usage["prompt_tokens"], usage["completion_tokens"], int(headers["x-bucket"]),
                   int(headers["x-padded-tokens"]), payload)


def words(n: int) -> str:
    """A prompt of exactly n tokens for the tiny word-level tokenizer (no BOS is added)."""
    return " ".join(f"w{i}" for i in range(n))
