"""The two sides `bucketserve verify` compares: the engine (built by the same composition root as `serve`)
or a running server, each against the float32 reference on the same token ids."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from buckets import BucketTable
from models.loading import resolve_model_path
from server.commands.verify import Outcome, engine_outcomes, reference_outcomes
from server.commands.verify_cases import Case, plan_cases
from server.config import ServerSettings

Run = tuple[BucketTable, str, list[Case], list[Outcome], list[Outcome], dict[str, int], str]


def _token_source(tokenizer: Any, prompts_file: str = "") -> list[int]:
    """The text cases are cut from, tokenized by the model's own tokenizer: a user's file (plain text, or
    JSONL with a 'prompt' per line), else the bench's English corpus."""
    if prompts_file:
        raw = Path(prompts_file).read_text()
        lines = [line for line in raw.splitlines() if line.strip()]
        if lines and all(line.lstrip().startswith("{") for line in lines):
            text = "\n".join(str(json.loads(line).get("prompt", "")) for line in lines)
        else:
            text = raw
    else:
        from bench.prompts import load_corpus

        text = load_corpus()
    return list(tokenizer.encode(text)[:20000])


def run_engine(settings: ServerSettings, args: argparse.Namespace) -> Run:
    from server.compose import build_engine

    engine, _ = build_engine(settings)
    cases = plan_cases(engine.table, _token_source(engine.tokenizer, args.prompts_file), args.max_tokens,
                       args.num_prompts)

    async def drive() -> list[Outcome]:
        engine.start()
        try:
            while not engine.is_ready():
                if not engine.is_alive():
                    raise RuntimeError(f"the engine failed to start: {engine.progress().failed}")
                await asyncio.sleep(0.1)
            return await engine_outcomes(engine, cases)
        finally:
            engine.stop()

    ours = asyncio.run(drive())
    runner = engine.model.runner
    graphs = {str(k): n for k, n in runner.calls.items()} if runner is not None else {}
    ref = reference_outcomes(engine.model.path, cases, args.reference_dtype)
    return engine.table, engine.model.dtype, cases, ours, ref, graphs, engine.model.name


def run_against(settings: ServerSettings, args: argparse.Namespace) -> Run:
    """Cases sized by the local settings' table, sent as token ids to args.against; greedy, ignore_eos."""
    from transformers import AutoConfig

    from models.loading import load_tokenizer, max_positions

    path = resolve_model_path(settings.model, settings.model_cache_dir or None)
    table = settings.bucket_table(max_positions(AutoConfig.from_pretrained(path)))
    tokenizer = load_tokenizer(path)
    cases = plan_cases(table, _token_source(tokenizer, args.prompts_file), args.max_tokens, args.num_prompts)
    url = args.against.rstrip("/")
    with httpx.Client(timeout=600.0) as client:
        models = client.get(url + "/v1/models").json().get("data") or [{}]
        name = str(models[0].get("id", "model"))
        ours = [_remote(client, url, name, case, tokenizer) for case in cases]
    # The remote dtype is unknown: an explicit --dtype float32 asks for the exact rule, anything else the threshold.
    dtype = settings.dtype if settings.dtype != "auto" else "remote"
    return table, dtype, cases, ours, reference_outcomes(path, cases, args.reference_dtype), {}, name


def _remote(client: httpx.Client, url: str, model: str, case: Case, tokenizer: Any) -> Outcome:
    """One completion by token ids; the text is mapped back to token ids with the same tokenizer (exact
    for the tokens both sides agree on, which is what the prefix agreement counts)."""
    body = {"model": model, "prompt": list(case.ids), "max_tokens": case.max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 5 if case.logprobs else None}
    t0 = time.monotonic()
    resp = client.post(url + "/v1/completions", json=body)
    if resp.status_code != 200:
        return Outcome([], {}, f"HTTP {resp.status_code} after {time.monotonic() - t0:.1f} s: {resp.text[:200]}")
    choice = resp.json()["choices"][0]
    tokens = list(tokenizer.encode(choice.get("text", ""), add_special_tokens=False))
    first: dict[int, float] = {}
    top = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0]
    if isinstance(top, dict):
        for text, lp in top.items():
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1:
                first[ids[0]] = float(lp)
    return Outcome(tokens[: case.max_tokens], first)
