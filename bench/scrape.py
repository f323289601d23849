"""Scrape a target's Prometheus /metrics (text format) for warm-up time and recompilations.

A tiny parser of our own: the bench is a client and must not depend on the server's prometheus-client.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import httpx

PREFIX = "bucketserve_"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def _unescape(value: str) -> str:
    return value.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a text exposition; comments and malformed lines are skipped."""
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted((k, _unescape(v)) for k, v in _LABEL.findall(m.group(2) or "")))
        out.append(Sample(m.group(1), labels, value))
    return out


def metric_total(samples: list[Sample], name: str, **labels: str) -> float | None:
    """Sum of every sample of `name` whose labels include `labels`; None when the metric is absent."""
    found = [s for s in samples if s.name == name and all(s.label(k) == v for k, v in labels.items())]
    if not found:
        return None
    return sum(s.value for s in found if not math.isnan(s.value))


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the bench reads from a bucketserve target; every field None on other servers."""

    available: bool
    is_bucketserve: bool
    warmup_seconds: float | None = None
    recompilations: float | None = None
    serving_compilations: float | None = None


def snapshot(samples: list[Sample] | None) -> MetricsSnapshot:
    if samples is None:
        return MetricsSnapshot(available=False, is_bucketserve=False)
    return MetricsSnapshot(
        available=True,
        is_bucketserve=any(s.name.startswith(PREFIX) for s in samples),
        warmup_seconds=metric_total(samples, PREFIX + "warmup_seconds"),
        recompilations=metric_total(samples, PREFIX + "recompilations_total"),
        serving_compilations=metric_total(samples, PREFIX + "graph_compilations_total", phase="serving"),
    )


def scrape(base_url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> MetricsSnapshot:
    """Snapshot of GET {base}/metrics; unavailable (not an error) when the server has none."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers or {}, timeout=timeout)
    except httpx.HTTPError:
        return snapshot(None)
    if resp.status_code != 200:
        return snapshot(None)
    return snapshot(parse_prometheus(resp.text))


def scrape_all(urls: tuple[str, ...], headers: dict[str, str] | None = None) -> MetricsSnapshot:
    """One snapshot of replicas: counters summed, warm-up the slowest replica's; one URL is plain `scrape`."""
    snaps = [scrape(url, headers) for url in urls]
    if len(snaps) == 1:
        return snaps[0]
    if not all(s.available for s in snaps):
        return snapshot(None)

    def total(values: list[float | None]) -> float | None:
        return None if all(v is None for v in values) else sum(v or 0.0 for v in values)

    warm = [s.warmup_seconds for s in snaps if s.warmup_seconds is not None]
    return MetricsSnapshot(True, all(s.is_bucketserve for s in snaps), max(warm) if warm else None,
                           total([s.recompilations for s in snaps]), total([s.serving_compilations for s in snaps]))


def delta(before: float | None, after: float | None) -> float | None:
    """Counter increase over the run; a counter that appears only afterwards started from zero."""
    if after is None:
        return None
    return after - (before or 0.0)
