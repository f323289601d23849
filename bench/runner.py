"""Benchmark one target: probe how to talk to it, warm it, run every concurrency level, scrape metrics.

Warm-up (start-up, the /metrics warm-up time, the first request) is measured and reported apart from the
steady-state levels, which only begin after the warm-up requests.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import scrape as scr
from bench.client import ApiMode, RequestResult
from bench.loadgen import LevelRun, run_level_sync, send_one
from bench.prompts import Prompt
from bench.servers import RunningServer, ServerGroup
from bench.stats import level_stats


@dataclass(frozen=True)
class RunOptions:
    concurrency: tuple[int, ...]
    timeout: float = 600.0
    max_seconds: float = 0.0  # per level; 0 = no limit
    warmup_requests: int = 1
    ignore_eos: bool = True
    endpoint: str = "completions"
    temperature: float = 0.0
    served_model: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    rounds: int = 1  # every level run this many times; a level's rounds are pooled in its figures

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive integers, got {list(self.concurrency)}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout}")
        if self.max_seconds < 0:
            raise ValueError(f"max_seconds must be >= 0, got {self.max_seconds}")
        if self.warmup_requests < 1:
            raise ValueError(
                f"warmup_requests must be >= 1 (the first request probes the API), got {self.warmup_requests}"
            )


@dataclass
class TargetRun:
    name: str
    url: str
    summary: dict[str, Any]
    levels: list[LevelRun] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.summary.get("error") is None


def discover_model(base_url: str, headers: dict[str, str]) -> str | None:
    """The first model id of GET /v1/models (servers pinned to one model insist on its name)."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        return str(data[0]["id"])
    return None


def probe_mode(
    base_url: str, prompt: Prompt, opts: RunOptions, model: str | None
) -> tuple[ApiMode, RequestResult, list[str]]:
    """Find a request shape the server accepts, best first: token-id prompts, then text; ignore_eos,
    then a generation_config with min_new_tokens (transformers), then nothing. A 400/422 whose message
    names the rejected field decides what to drop; the last answer is returned when nothing works."""
    formats = ["ids", "text"] if opts.endpoint == "completions" else ["text"]
    eos_modes = ["ignore_eos", "generation_config", "none"] if opts.ignore_eos else ["none"]
    fi = ei = 0
    notes: list[str] = []
    headers = dict(opts.headers)
    while True:
        mode = ApiMode(opts.endpoint, formats[fi], eos_modes[ei], model, opts.temperature)
        res = send_one(base_url, prompt, mode, opts.timeout, headers)
        if res.ok or res.status not in (400, 422):
            return mode, res, notes
        detail = res.detail.lower()
        if eos_modes[ei] != "none" and eos_modes[ei] in detail and ei + 1 < len(eos_modes):
            ei += 1
        elif "prompt" in detail and fi + 1 < len(formats):
            fi += 1
        elif ei + 1 < len(eos_modes):
            ei += 1
        elif fi + 1 < len(formats):
            fi, ei = fi + 1, 0
        else:
            return mode, res, notes
        notes.append(f"{mode.prompt_format}/{mode.eos} rejected (HTTP {res.status}: {res.detail[:120]}); "
                     f"trying {formats[fi]}/{eos_modes[ei]}")


class TargetSession:
    """One target's benchmark in phases, so that several targets' levels and probes can take turns
    (`bench.compare.run_compare(interleave=True)`): `begin` (API probe, warm-up), `run_level` per concurrency,
    `probe` per TTFT probe prompt, `finish` (metrics, summary). `run_target` runs them in order."""

    def __init__(self, name: str, base_url: str, prompts: list[Prompt], opts: RunOptions,
                 server: RunningServer | ServerGroup | None = None, ready_seconds: float | None = None,
                 replicas: tuple[str, ...] = ()) -> None:
        self.name, self.base_url, self.prompts, self.opts = name, base_url, prompts, opts
        self.server, self.ready_seconds = server, ready_seconds
        self.headers = dict(opts.headers)
        self.urls = (base_url, *replicas)
        self.runs: list[LevelRun] = []
        self.cpu: list[float | None] = []
        self.probe_times: dict[str, list[float]] = {}
        self.ok = False

    def begin(self) -> None:
        """Scrape the metrics before, find the request shape, send the warm-up requests."""
        opts, headers, base_url = self.opts, self.headers, self.base_url
        self.before = scr.scrape_all(self.urls, headers)
        model = opts.served_model or discover_model(base_url, headers)
        mode, first, notes = probe_mode(base_url, self.prompts[0], opts, model)
        self.mode, self.notes = mode, notes
        self.summary: dict[str, Any] = {
            "name": self.name,
            "url": base_url,
            "is_bucketserve": self.before.is_bucketserve,
            "api": {"endpoint": mode.endpoint, "prompt_format": mode.prompt_format, "eos": mode.eos, "model": model},
            "notes": notes,
            "startup": {
                "ready_seconds": self.ready_seconds,  # process start -> /ready (or /health) 200; None if not ours
                "warmup_seconds_metric": self.before.warmup_seconds,  # bucketserve_warmup_seconds
                "first_request_seconds": first.e2e,
            },
            "error": None,
        }
        if mode.prompt_format == "text" and any(p.text_tokens != len(p.ids) for p in self.prompts):
            notes.append("some text prompts tokenize to one token more than planned (no exact prefix)")
        if mode.endpoint == "chat":
            notes.append("chat endpoint: prompts go through the chat template, so prompt lengths are not exact")
        if mode.eos == "none" and opts.ignore_eos:
            notes.append("server accepts no way to ignore EOS: outputs may be shorter than max_tokens")
        if not first.ok:
            self.summary["error"] = f"first request failed: {first.error} {first.detail}"
            return
        self.ok = True
        for prompt in self.prompts[1 : opts.warmup_requests]:
            send_one(base_url, prompt, mode, opts.timeout, headers)
        for url in self.urls[1:]:  # each replica's first request, untimed
            send_one(url, self.prompts[0], mode, opts.timeout, headers)

    def run_level(self, concurrency: int) -> None:
        """One closed-loop level over every prompt (nothing when the first request failed)."""
        if not self.ok:
            return
        server, opts = self.server, self.opts
        cpu_before = server.cpu_seconds() if server is not None else None
        run = run_level_sync(list(self.urls), self.prompts, self.mode, concurrency, timeout=opts.timeout,
                             max_seconds=opts.max_seconds, headers=self.headers)
        cpu_after = server.cpu_seconds() if server is not None else None
        # CPU-seconds the server used per second of wall time: an engine quietly using a second core shows.
        ok = cpu_before is not None and cpu_after is not None and run.wall_seconds > 0
        self.cpu.append((cpu_after - cpu_before) / run.wall_seconds if ok else None)  # type: ignore[operator]
        self.runs.append(run)
        if not run.issued_all:
            self.notes.append(f"concurrency {concurrency}: time limit reached after {len(run.results)} of "
                              f"{len(self.prompts)} requests")

    def probe(self, prompt: Prompt) -> None:
        """One TTFT probe: a single request, nothing else in flight; its TTFT joins those of its prompt length
        (the report gives their median; repeats are distinct prompts of the same length)."""
        if not self.ok:
            return
        res = send_one(self.base_url, prompt, self.mode, self.opts.timeout, self.headers)
        got = self.probe_times.setdefault(str(len(prompt.ids)), [])
        if res.ok and res.ttft is not None:
            got.append(res.ttft)

    def finish(self) -> TargetRun:
        """Scrape the metrics after; the target's summary."""
        summary = self.summary
        if self.probe_times:
            summary["ttft_probe"] = {n: statistics.median(t) if t else None for n, t in self.probe_times.items()}
        after = scr.scrape_all(self.urls, self.headers)
        summary["recompilations"] = scr.delta(self.before.recompilations, after.recompilations)
        summary["serving_compilations"] = scr.delta(self.before.serving_compilations, after.serving_compilations)
        server = self.server
        summary["peak_rss_bytes"] = server.peak_rss_bytes() if server is not None else None
        summary["peak_rss_tree_bytes"] = server.peak_rss_bytes(tree=True) if server is not None else None
        runs, cpu, rounds = _pooled(self.runs, self.cpu)
        summary["levels"] = [_level_summary(run) for run in runs]
        for level, used, each in zip(summary["levels"], cpu, rounds):
            level["server_cpu_per_second"] = used
            if len(each) > 1:  # what each round alone made: the spread the pooled figure hides
                level["round_output_tokens_per_s"] = each
        return TargetRun(self.name, self.base_url, summary, runs)


def run_target(
    name: str,
    base_url: str,
    prompts: list[Prompt],
    opts: RunOptions,
    server: RunningServer | ServerGroup | None = None,
    ready_seconds: float | None = None,
    probes: list[Prompt] | None = None,
    replicas: tuple[str, ...] = (),
) -> TargetRun:
    """`replicas`: more URLs of the same model (data parallel); the levels spread their clients over
    base_url and these, and their metrics are summed."""
    session = TargetSession(name, base_url, prompts, opts, server, ready_seconds, replicas)
    session.begin()
    for _ in range(opts.rounds):
        for c in opts.concurrency:
            session.run_level(c)
    for prompt in probes or ():
        session.probe(prompt)
    return session.finish()


def _pooled(runs: list[LevelRun], cpu: list[float | None]
            ) -> tuple[list[LevelRun], list[float | None], list[list[float | None]]]:
    """A level's rounds as one run (requests concatenated, wall seconds summed; CPU use weighted by wall time),
    in the order the levels first ran; and each round's output tokens/s."""
    order: list[int] = []
    by_level: dict[int, list[tuple[LevelRun, float | None]]] = {}
    for run, used in zip(runs, cpu):
        if run.concurrency not in by_level:
            order.append(run.concurrency)
        by_level.setdefault(run.concurrency, []).append((run, used))
    pooled, pooled_cpu, rounds = [], [], []
    for c in order:
        group = by_level[c]
        wall = sum(r.wall_seconds for r, _ in group)
        pooled.append(LevelRun(c, [res for r, _ in group for res in r.results], wall, all(r.issued_all for r, _ in group)))
        weighted = [u * r.wall_seconds for r, u in group if u is not None]
        pooled_cpu.append(sum(weighted) / wall if len(weighted) == len(group) and wall > 0 else None)
        rounds.append([level_stats(r.results, r.wall_seconds, c)["output_tokens_per_s"] for r, _ in group])
    return pooled, pooled_cpu, rounds


def _level_summary(run: LevelRun) -> dict[str, Any]:
    stats = level_stats(run.results, run.wall_seconds, run.concurrency)
    stats["issued_all"] = run.issued_all
    stats["request_records"] = [r.to_dict() for r in run.results]
    return stats


def failed_target(name: str, url: str, error: str) -> TargetRun:
    """A server that could not be started or benchmarked still appears in the report."""
    return TargetRun(name, url, {"name": name, "url": url, "error": error, "levels": [], "notes": []})
