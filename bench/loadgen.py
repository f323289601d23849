"""Closed-loop load: N clients, each sending its next request as soon as its previous one ended."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Sequence

import httpx

from bench.client import ApiMode, RequestResult, next_pow2, stream_request
from bench.prompts import Prompt


@dataclass(frozen=True)
class LevelRun:
    concurrency: int
    results: list[RequestResult]  # in request order
    wall_seconds: float  # first send to last stream end
    issued_all: bool  # False when the time limit stopped the level early


async def _one(
    client: httpx.AsyncClient, base_url: str, prompt: Prompt, mode: ApiMode, timeout: float
) -> RequestResult:
    start = time.perf_counter()
    try:
        return await asyncio.wait_for(stream_request(client, base_url, prompt, mode), timeout)
    except TimeoutError:
        # the whole request took longer than the per-request limit (httpx only bounds each read)
        res = RequestResult(prompt.index, len(prompt.ids), next_pow2(len(prompt.ids)), start, error="timeout")
        res.detail, res.e2e = f"no complete response within {timeout:g} s", time.perf_counter() - start
        return res


async def run_level(
    base_url: str | Sequence[str],
    prompts: list[Prompt],
    mode: ApiMode,
    concurrency: int,
    *,
    timeout: float = 600.0,
    max_seconds: float = 0.0,
    headers: dict[str, str] | None = None,
) -> LevelRun:
    """Send every prompt once with `concurrency` clients; stop issuing after `max_seconds` (0 = no limit).
    Several URLs (replicas): client i always talks to URL i mod n, as a per-connection load balancer would."""
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if concurrency < 1:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    results: list[RequestResult] = []
    pending = list(reversed(prompts))  # pop() from the end hands them out in order
    start = time.perf_counter()
    deadline = start + max_seconds if max_seconds > 0 else math.inf
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, headers=headers or {}) as client:

        async def worker(url: str) -> None:
            while pending and time.perf_counter() < deadline:
                results.append(await _one(client, url, pending.pop(), mode, timeout))

        await asyncio.gather(*(worker(urls[i % len(urls)]) for i in range(concurrency)))
    end = max((r.start + (r.e2e or 0.0) for r in results), default=time.perf_counter())
    results.sort(key=lambda r: r.index)
    return LevelRun(concurrency, results, max(end - start, 0.0), issued_all=not pending)


def run_level_sync(
    base_url: str | Sequence[str],
    prompts: list[Prompt],
    mode: ApiMode,
    concurrency: int,
    *,
    timeout: float = 600.0,
    max_seconds: float = 0.0,
    headers: dict[str, str] | None = None,
) -> LevelRun:
    return asyncio.run(
        run_level(base_url, prompts, mode, concurrency, timeout=timeout, max_seconds=max_seconds, headers=headers)
    )


async def _single(
    base_url: str, prompt: Prompt, mode: ApiMode, timeout: float, headers: dict[str, str] | None
) -> RequestResult:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), headers=headers or {}) as client:
        return await _one(client, base_url, prompt, mode, timeout)


def send_one(
    base_url: str, prompt: Prompt, mode: ApiMode, timeout: float = 600.0, headers: dict[str, str] | None = None
) -> RequestResult:
    """One request outside any level (probing and warm-up)."""
    return asyncio.run(_single(base_url, prompt, mode, timeout, headers))
