"""Workload description: prompt and output length distributions, and the seeded request plan.

A plan fixes every request's prompt length, output length and corpus offset from the seed alone, so the
same command drives every server with exactly the same requests.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = ("fixed", "uniform", "lognormal")


class WorkloadError(ValueError):
    """A workload option has a bad value; the message names it."""


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed N, uniform lo..hi (inclusive), or lognormal(median, sigma)."""

    kind: str
    a: float  # fixed: N; uniform: lo; lognormal: median
    b: float = 0.0  # uniform: hi; lognormal: sigma

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WorkloadError(f"length distribution kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "fixed" and (self.a < 1 or self.a != int(self.a)):
            raise WorkloadError(f"fixed length must be a positive integer, got {self.a}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise WorkloadError(f"uniform lengths need 1 <= lo <= hi, got lo={self.a} hi={self.b}")
        if self.kind == "lognormal" and (self.a <= 0 or self.b < 0 or not math.isfinite(self.b)):
            raise WorkloadError(f"lognormal needs median > 0 and finite sigma >= 0, got median={self.a} sigma={self.b}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.lognormvariate(math.log(self.a), self.b)))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}..{int(self.b)}"
        return f"lognormal:median={self.a:g},sigma={self.b:g}"


def parse_length_dist(text: str) -> LengthDist:
    """`128` / `fixed:128`, `uniform:32..512` (or `32-512`), `lognormal:median=128,sigma=0.6` (or `128,0.6`)."""
    kind, _, rest = text.strip().partition(":")
    if not rest:
        kind, rest = "fixed", kind
    kind = kind.strip().lower()
    try:
        if kind == "fixed":
            return LengthDist("fixed", float(int(rest)))
        if kind == "uniform":
            sep = ".." if ".." in rest else "-"
            lo, hi = rest.split(sep)
            return LengthDist("uniform", float(int(lo)), float(int(hi)))
        if kind == "lognormal":
            values: dict[str, float] = {}
            for i, part in enumerate(p for p in rest.split(",") if p.strip()):
                key, eq, val = part.partition("=")
                values[key.strip() if eq else ("median", "sigma")[i]] = float(val if eq else key)
            if set(values) != {"median", "sigma"}:
                raise WorkloadError(f"lognormal needs median and sigma, got {text!r}")
            return LengthDist("lognormal", values["median"], values["sigma"])
    except (ValueError, IndexError) as exc:
        if isinstance(exc, WorkloadError):
            raise
        raise WorkloadError(f"cannot parse length distribution {text!r}: {exc}") from exc
    raise WorkloadError(f"length distribution kind must be one of {', '.join(KINDS)}; got {kind!r} in {text!r}")


@dataclass(frozen=True)
class FilePrompt:
    """One line of a JSONL prompts file: text, and optionally its own output length."""

    text: str
    max_tokens: int | None = None


def read_prompts_file(path: str | Path) -> list[FilePrompt]:
    """JSONL: each line a JSON string, or an object with "prompt" (or "text") and optional "max_tokens"."""
    out: list[FilePrompt] = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
        if isinstance(item, str):
            out.append(FilePrompt(item))
            continue
        text = item.get("prompt", item.get("text")) if isinstance(item, dict) else None
        if not isinstance(text, str) or not text:
            raise WorkloadError(f"{path}:{lineno}: expected a string or an object with a 'prompt' string")
        max_tokens = item.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise WorkloadError(f"{path}:{lineno}: max_tokens must be a positive integer, got {max_tokens!r}")
        out.append(FilePrompt(text, max_tokens))
    if not out:
        raise WorkloadError(f"{path}: no prompts")
    return out


@dataclass(frozen=True)
class WorkloadSpec:
    prompt_len: LengthDist
    output_len: LengthDist
    num_requests: int
    seed: int = 0
    max_prompt_len: int = 1024
    prompts_file: str = ""  # when set, prompts come from the file (cycled) instead of prompt_len

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError(f"num_requests must be positive, got {self.num_requests}")
        if self.max_prompt_len < 1:
            raise WorkloadError(f"max_prompt_len must be positive, got {self.max_prompt_len}")

    def describe(self) -> dict[str, object]:
        return {
            "prompt_len": "file:" + self.prompts_file if self.prompts_file else self.prompt_len.describe(),
            "output_len": self.output_len.describe(),
            "num_requests": self.num_requests,
            "seed": self.seed,
            "max_prompt_len": self.max_prompt_len,
        }


@dataclass(frozen=True)
class RequestPlan:
    """One request before its prompt is materialised. `source` indexes the prompts file (or -1: corpus);
    `offset` is where in the corpus the prompt text starts, so requests do not share a prefix."""

    index: int
    prompt_len: int  # target tokens; 0 = the whole file prompt (capped at max_prompt_len)
    output_len: int
    offset: int
    source: int = -1


def plan_requests(
    spec: WorkloadSpec, corpus_chars: int, file_prompts: list[FilePrompt] | None = None
) -> list[RequestPlan]:
    """The seeded plan: same spec and corpus give the same requests, whatever server runs them."""
    rng = random.Random(spec.seed)
    plans: list[RequestPlan] = []
    for i in range(spec.num_requests):
        output_len = spec.output_len.sample(rng)
        offset = rng.randrange(max(1, corpus_chars))
        if file_prompts:
            source = i % len(file_prompts)
            own = file_prompts[source].max_tokens
            plans.append(RequestPlan(i, 0, own if own is not None else output_len, 0, source))
        else:
            length = min(spec.max_prompt_len, spec.prompt_len.sample(rng))
            plans.append(RequestPlan(i, length, output_len, offset))
    return plans
