"""`bucketserve verify`: the serving path against the portable reference, before a deploy.

Runs the real engine (the same graphs, scheduler, slot cache and sampling path as `serve`) on the cases of
`server.commands.verify_cases` and compares each with transformers' eager `generate` in float32 on CPU (dynamic cache,
no padding, one request at a time). Per request bucket it reports greedy agreement, the first divergence and
the largest logprob difference at the first generated position; it lists the graphs the run exercised.
With `--against URL` the cases go, as token ids, to a running OpenAI-compatible server instead.

Exit status: 0 when every float32 output matches the reference token for token (or, for another dtype, the
token agreement reaches --min-agreement); 1 otherwise; 2 for bad settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from buckets import BucketTable
from server.commands.verify_cases import Case
from server.config import ServerSettings, SettingsError

# Token agreement below which a reduced-precision run fails: the default model in bfloat16 measured 0.85 over
# the default table's 19 cases (docs/verify.md); 0.6 leaves room for other prompts and catches gross breakage.
DEFAULT_MIN_AGREEMENT = 0.6


@dataclass
class Outcome:
    """What one side produced for a case: tokens, and logprobs of the first position when asked."""

    tokens: list[int]
    first_logprobs: dict[int, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class CaseReport:
    name: str
    bucket: int
    prompt_len: int
    wave: int
    matched: int  # tokens equal to the reference before the first divergence, of the `total` scored
    total: int  # tokens the agreement score counts for this case (Case.scored)
    first_divergence: int | None  # index of the first differing token; None when equal
    max_logprob_diff: float | None
    error: str = ""


def reference_outcomes(model_path: str, cases: list[Case], dtype: str = "float32") -> list[Outcome]:
    """transformers' eager generate in `dtype` (float32: the reference; bfloat16: to measure how far another
    configuration, e.g. --quantize int8, strays from plain bf16), dynamic cache, one unpadded request at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    out = []
    with torch.no_grad():
        for case in cases:
            ids = torch.tensor([case.ids])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=case.max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            first = torch.log_softmax(gen.scores[0][0].float(), dim=-1)
            out.append(Outcome(gen.sequences[0, len(case.ids):].tolist(), {i: float(v) for i, v in enumerate(first)}))
    return out


async def engine_outcomes(engine: Any, cases: list[Case], timeout: float = 600.0) -> list[Outcome]:
    """Submit wave 0 at once, wave 1 once wave 0 is decoding; collect every stream."""
    from models.sampling import SamplingParams

    results: list[Outcome | None] = [None] * len(cases)

    async def collect(i: int, handle: Any) -> None:
        tokens: list[int] = []
        first: dict[int, float] = {}
        error = ""
        async for event in handle:
            if event.token_id is not None:
                if not tokens and event.top_logprobs:
                    first = dict(event.top_logprobs)
                tokens.append(event.token_id)
            if event.finish_reason in ("error", "abort"):
                error = event.error or event.finish_reason
        results[i] = Outcome(tokens, first, error)

    def submit(i: int) -> asyncio.Task[None]:
        case = cases[i]
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0, ignore_eos=True,
                                logprobs=5 if case.logprobs else None)
        return asyncio.create_task(collect(i, engine.submit(list(case.ids), params)))

    first_wave = [submit(i) for i, c in enumerate(cases) if c.wave == 0]
    deadline = time.monotonic() + timeout
    while engine.num_running() == 0 and time.monotonic() < deadline and not all(t.done() for t in first_wave):
        await asyncio.sleep(0.005)
    second_wave = [submit(i) for i, c in enumerate(cases) if c.wave == 1]
    await asyncio.wait_for(asyncio.gather(*first_wave, *second_wave), timeout)
    return [r if r is not None else Outcome([], {}, "no result") for r in results]


def compare(table: BucketTable, cases: list[Case], ours: list[Outcome], ref: list[Outcome]) -> list[CaseReport]:
    reports = []
    for case, got, want in zip(cases, ours, ref):
        agree = 0
        for a, b in zip(got.tokens, want.tokens):
            if a != b:
                break
            agree += 1
        equal = got.tokens == want.tokens and not got.error
        scored = case.scored or case.max_tokens  # the agreement score's share of this case (Case.scored)
        diffs = [abs(lp - want.first_logprobs[t]) for t, lp in got.first_logprobs.items() if t in want.first_logprobs]
        reports.append(CaseReport(case.name, table.length_for(case.prompt_len), case.prompt_len, case.wave,
                                  min(agree, scored), min(len(want.tokens), scored), None if equal else agree,
                                  max(diffs) if diffs else None, got.error))
    return reports


def summarize(reports: list[CaseReport]) -> dict[int, dict[str, Any]]:
    """Per request bucket: cases, exact cases, token agreement, earliest divergence, largest logprob diff."""
    out: dict[int, dict[str, Any]] = {}
    for r in sorted(reports, key=lambda r: r.bucket):
        s = out.setdefault(r.bucket, {"cases": 0, "exact": 0, "matched": 0, "total": 0, "first_divergence": None,
                                      "max_logprob_diff": None})
        s["cases"] += 1
        s["exact"] += r.first_divergence is None and not r.error
        s["matched"] += r.matched
        s["total"] += r.total
        if r.first_divergence is not None:
            fd = s["first_divergence"]
            s["first_divergence"] = r.first_divergence if fd is None else min(fd, r.first_divergence)
        if r.max_logprob_diff is not None:
            s["max_logprob_diff"] = max(s["max_logprob_diff"] or 0.0, r.max_logprob_diff)
    for s in out.values():
        s["agreement"] = s["matched"] / s["total"] if s["total"] else 1.0
    return out


def markdown(meta: dict[str, Any], reports: list[CaseReport], graphs: dict[str, int]) -> str:
    buckets = summarize(reports)
    quantized = ", int8 weights" if meta.get("quantize") == "int8" else ""
    lines = [f"# bucketserve verify: {meta['model']} ({meta['dtype']}{quantized}, {meta['backend']}) against eager "
             f"{meta.get('reference_dtype', 'float32')}", "",
             f"{len(reports)} cases, token agreement {meta['agreement']:.4f}, verdict: **{meta['verdict']}** "
             f"({meta['rule']}); {meta['seconds']:.1f} s.", "",
             "| bucket | cases | exact | token agreement | first divergence | max logprob diff (first token) |",
             "|---|---|---|---|---|---|"]
    for bucket, s in buckets.items():
        fd = "–" if s["first_divergence"] is None else str(s["first_divergence"])
        lp = "–" if s["max_logprob_diff"] is None else f"{s['max_logprob_diff']:.2e}"
        lines.append(f"| {bucket} | {s['cases']} | {s['exact']} | {s['agreement']:.3f} | {fd} | {lp} |")
    if graphs:
        lines += ["", "Graphs exercised (calls): " + ", ".join(f"{k} {v}" for k, v in sorted(graphs.items()))]
    failing = [r for r in reports if r.first_divergence is not None or r.error]
    if failing:
        lines += ["", "| case | bucket | prompt | wave | first divergence | error |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.name} | {r.bucket} | {r.prompt_len} | {r.wave} | {r.first_divergence} | {r.error} |"
                  for r in failing]
    return "\n".join(lines) + "\n"


def verdict(dtype: str, reports: list[CaseReport], min_agreement: float, reference_dtype: str = "float32"
            ) -> tuple[bool, float, str]:
    matched = sum(r.matched for r in reports)
    total = sum(r.total for r in reports) or 1
    agreement = matched / total
    if any(r.error for r in reports):
        return False, agreement, "a request failed"
    if dtype == "float32" and reference_dtype == "float32":
        return all(r.first_divergence is None for r in reports), agreement, "float32: every token must match"
    return agreement >= min_agreement, agreement, f"{dtype}: token agreement >= {min_agreement}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--against", default="", help="verify a running OpenAI-compatible server at this URL")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per case")
    parser.add_argument("--num-prompts", type=int, default=0, help="keep the first N cases (0: all)")
    parser.add_argument("--prompts-file", default="",
                        help="your own text (plain, or JSONL with a 'prompt' field per line) to cut the cases from, "
                        "instead of the built-in English corpus")
    parser.add_argument("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT,
                        help="token agreement a non-float32 configuration must reach")
    parser.add_argument("--reference-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of transformers' eager reference (float32: the exactness check; bfloat16: "
                             "agreement of e.g. --quantize int8 with plain bf16)")
    parser.add_argument("--out", default="results/verify", help="where report.json and report.md go")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what would run a different check than asked (exit 2), before anything loads."""
    if args.max_tokens < 1:
        raise SettingsError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.num_prompts < 0:
        raise SettingsError(f"--num-prompts must be >= 0 (0: every case), got {args.num_prompts}")
    if not 0 <= args.min_agreement <= 1:  # NaN too
        raise SettingsError(f"--min-agreement is a fraction of tokens in [0, 1], got {args.min_agreement}")


def verify_main(settings: ServerSettings, args: argparse.Namespace) -> int:
    from server.commands.verify_run import run_against, run_engine

    check_arguments(args)
    t0 = time.monotonic()
    if args.against:
        table, dtype, cases, ours, ref, graphs, model_name = run_against(settings, args)
        backend = "remote"
    else:
        table, dtype, cases, ours, ref, graphs, model_name = run_engine(settings, args)
        backend = settings.compile_backend
    reports = compare(table, cases, ours, ref)
    ok, agreement, rule = verdict(dtype, reports, args.min_agreement, args.reference_dtype)
    meta = {"model": model_name, "dtype": dtype, "quantize": settings.quantize, "reference_dtype": args.reference_dtype,
            "backend": backend, "against": args.against or None,
            "agreement": agreement, "verdict": "pass" if ok else "FAIL", "rule": rule,
            "seconds": time.monotonic() - t0, "buckets": table.to_dict()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(
        {**meta, "graphs": graphs, "per_bucket": {str(k): v for k, v in summarize(reports).items()},
         "cases": [asdict(r) for r in reports]}, indent=2) + "\n")
    text = markdown(meta, reports, graphs)
    (out / "report.md").write_text(text)
    print(text)
    return 0 if ok else 1
