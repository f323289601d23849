"""The result document (JSON), its Markdown summary, and comparison ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.runner import TargetRun

RATIO_METRICS = (
    ("output_tokens_per_s", None, "throughput"),
    ("ttft", "p50", "TTFT p50"),
    ("tpot", "p50", "TPOT p50"),
    ("e2e", "p50", "E2E p50"),
)


def _metric(level: dict[str, Any], key: str, sub: str | None) -> float | None:
    value = level.get(key)
    if sub is not None:
        value = value.get(sub) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def ratios(targets: list[TargetRun]) -> list[dict[str, Any]]:
    """Each other target against the first successful one, per concurrency: other / baseline."""
    good = [t for t in targets if t.ok and t.summary.get("levels")]
    if len(good) < 2:
        return []
    base = good[0]
    base_levels = {lv["concurrency"]: lv for lv in base.summary["levels"]}
    out: list[dict[str, Any]] = []
    for other in good[1:]:
        for lv in other.summary["levels"]:
            ref = base_levels.get(lv["concurrency"])
            if ref is None:
                continue
            row: dict[str, Any] = {"baseline": base.name, "target": other.name, "concurrency": lv["concurrency"]}
            for key, sub, label in RATIO_METRICS:
                a, b = _metric(lv, key, sub), _metric(ref, key, sub)
                row[label] = a / b if a is not None and b else None
            out.append(row)
    return out


def document(meta: dict[str, Any], targets: list[TargetRun]) -> dict[str, Any]:
    return {**meta, "targets": [t.summary for t in targets], "ratios": ratios(targets)}


def write_json(out_dir: Path, doc: dict[str, Any]) -> Path:
    path = out_dir / "result.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def _f(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if not isinstance(value, (int, float)) else f"{value * scale:.{digits}f}"


def _pcts(summary: Any, scale: float, digits: int = 1) -> str:
    if not isinstance(summary, dict) or summary.get("p50") is None:
        return "–"
    return " / ".join(_f(summary.get(k), scale, digits) for k in ("p50", "p90", "p99"))


ITL_LEVEL = 8  # the headline's inter-token latency is read at this many clients (or the nearest level)


def headline(t: dict[str, Any], probe_lengths: list[str], levels: list[int]) -> dict[str, Any]:
    """One engine's headline figures: TTFT p50 per probe length, one-stream decode tok/s, output tok/s and
    server CPU-seconds per wall second per level, ITL p50/p99 near ITL_LEVEL clients."""
    by_c = {lv["concurrency"]: lv for lv in t.get("levels", [])}
    one = by_c.get(1)
    tpot = one["tpot"].get("p50") if one else None
    itl_c = min(by_c, key=lambda c: (abs(c - ITL_LEVEL), c)) if by_c else None
    itl = by_c[itl_c]["itl"] if itl_c is not None else {}
    probe = t.get("ttft_probe") or {}
    return {
        "ttft_ms": [_ms(probe.get(n)) for n in probe_lengths],
        "decode_tok_s": 1 / tpot if isinstance(tpot, (int, float)) and tpot > 0 else None,
        "out_tok_s": [by_c[c]["output_tokens_per_s"] if c in by_c else None for c in levels],
        "cpu_per_s": [by_c[c].get("server_cpu_per_second") if c in by_c else None for c in levels],
        "itl_level": itl_c,
        "itl_p50_ms": _ms(itl.get("p50")),
        "itl_p99_ms": _ms(itl.get("p99")),
    }


def _ms(seconds: Any) -> float | None:
    return float(seconds) * 1e3 if isinstance(seconds, (int, float)) else None


def _cells(values: list[Any], digits: int = 0) -> str:
    return " / ".join(_f(v, digits=digits) for v in values)


def headline_lines(doc: dict[str, Any]) -> list[str]:
    """The side-by-side table of the speed issue, plus bucketserve / vllm ratios when both ran."""
    targets = [t for t in doc["targets"] if t.get("levels")]
    if not targets:
        return []
    levels = list(doc.get("concurrency") or [])
    probe_lengths = sorted({n for t in targets for n in (t.get("ttft_probe") or {})}, key=int)
    rows = {t["name"]: headline(t, probe_lengths, levels) for t in targets}
    lines = ["## Headline", "",
             f"| engine | TTFT p50 ms at {'/'.join(probe_lengths) or '–'} tokens | decode tok/s, 1 stream | "
             f"out tok/s at {'/'.join(map(str, levels))} clients | ITL p50 (p99) ms | "
             "server CPU s per s at each level |", "|---|---|---|---|---|---|"]
    for name, h in rows.items():
        lines.append(f"| {name} | {_cells(h['ttft_ms'])} | {_f(h['decode_tok_s'])} | {_cells(h['out_tok_s'])} | "
                     f"{_f(h['itl_p50_ms'], digits=0)} ({_f(h['itl_p99_ms'], digits=0)}) at {h['itl_level']} | "
                     f"{_cells(h['cpu_per_s'], 2)} |")
    ours, theirs = rows.get("bucketserve"), rows.get("vllm")
    if ours and theirs:
        def ratio(a: Any, b: Any) -> float | None:
            return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None

        lines.append(
            f"| bucketserve / vllm | {_cells([ratio(a, b) for a, b in zip(ours['ttft_ms'], theirs['ttft_ms'])], 2)} | "
            f"{_f(ratio(ours['decode_tok_s'], theirs['decode_tok_s']), digits=2)} | "
            f"{_cells([ratio(a, b) for a, b in zip(ours['out_tok_s'], theirs['out_tok_s'])], 2)} | "
            f"{_f(ratio(ours['itl_p50_ms'], theirs['itl_p50_ms']), digits=2)} "
            f"({_f(ratio(ours['itl_p99_ms'], theirs['itl_p99_ms']), digits=2)}) | "
            f"{_cells([ratio(a, b) for a, b in zip(ours['cpu_per_s'], theirs['cpu_per_s'])], 2)} |")
    return lines + [""]


def _each(level: dict[str, Any]) -> str:
    """A pooled level's rounds: ' (r1, r2, ...)' output tok/s each, or nothing for one round."""
    each = level.get("round_output_tokens_per_s") or []
    return f" ({', '.join(_f(x) for x in each)})" if len(each) > 1 else ""


def _rounds(doc: dict[str, Any]) -> str:
    rounds = int(doc.get("rounds") or 1)
    return f" x {rounds} rounds (pooled)" if rounds > 1 else ""


def markdown(doc: dict[str, Any]) -> str:
    w = doc.get("workload", {})
    lines = [
        f"# bucketserve bench — {doc.get('created', '')}",
        "",
        f"Workload: prompts {w.get('prompt_len')} (max {w.get('max_prompt_len')}), outputs {w.get('output_len')}, "
        f"{w.get('num_requests')} requests per level{_rounds(doc)}, seed {w.get('seed')}; "
        f"tokenizer {doc.get('tokenizer')}; "
        f"threads {doc.get('threads') or 'default'}; dtype {doc.get('dtype') or 'each engine default'}.",
        "",
        *headline_lines(doc),
        "## Start-up and warm-up (not part of the steady-state figures)",
        "",
        "| server | ready (s) | warm-up metric (s) | first request (s) | peak RSS (MiB) | recompilations | API used |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in doc["targets"]:
        s = t.get("startup", {})
        api = t.get("api", {})
        rss = t.get("peak_rss_bytes")
        lines.append(
            f"| {t['name']} | {_f(s.get('ready_seconds'))} | {_f(s.get('warmup_seconds_metric'))} | "
            f"{_f(s.get('first_request_seconds'), digits=2)} | {_f(rss, 1 / 2**20, 0)} | "
            f"{_f(t.get('recompilations'), digits=0)} | "
            f"{api.get('endpoint', '–')}, {api.get('prompt_format', '–')} prompt, eos: {api.get('eos', '–')} |"
        )
    lines += [
        "",
        "## Steady state",
        "",
        "Latencies p50 / p90 / p99. ITL: gaps between streamed tokens; TPOT: (E2E − TTFT) / (tokens − 1)."
        + (" Levels pool their rounds; out tok/s gives each round's in brackets." if _rounds(doc) else ""),
        "",
        "| server | conc | ok / sent | out tok/s | req/s | TTFT (ms) | ITL (ms) | TPOT p50 (ms) | E2E (s) | failures |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in doc["targets"]:
        for lv in t.get("levels", []):
            fails = ", ".join(f"{k}: {v}" for k, v in lv["failures"].items()) or "none"
            lines.append(
                f"| {t['name']} | {lv['concurrency']} | {lv['completed']} / {lv['requests']} | "
                f"{_f(lv['output_tokens_per_s'])}{_each(lv)} | {_f(lv['requests_per_s'], digits=2)} | "
                f"{_pcts(lv['ttft'], 1e3)} | "
                f"{_pcts(lv['itl'], 1e3)} | {_f(lv['tpot'].get('p50'), 1e3)} | {_pcts(lv['e2e'], 1, 2)} | {fails} |"
            )
        if t.get("error"):
            lines.append(f"| {t['name']} | – | – | – | – | – | – | – | – | {t['error'][:200]} |")
    lines += ["", "## Per bucket", "", "| server | conc | bucket | requests | TTFT (ms) | ITL p50 (ms) | E2E (s) |",
              "|---|---|---|---|---|---|---|"]
    for t in doc["targets"]:
        for lv in t.get("levels", []):
            for bucket, b in lv["per_bucket"].items():
                lines.append(
                    f"| {t['name']} | {lv['concurrency']} | {bucket} | {b['requests']} | {_pcts(b['ttft'], 1e3)} | "
                    f"{_f(b['itl'].get('p50'), 1e3)} | {_pcts(b['e2e'], 1, 2)} |"
                )
    if doc.get("ratios"):
        lines += ["", "## Ratios (target / baseline; higher is better for throughput, lower for latency)", "",
                  "| target | baseline | conc | " + " | ".join(label for _, _, label in RATIO_METRICS) + " |",
                  "|---|---|---|" + "---|" * len(RATIO_METRICS)]
        for r in doc["ratios"]:
            cells = " | ".join(_f(r[label], digits=2) for _, _, label in RATIO_METRICS)
            lines.append(f"| {r['target']} | {r['baseline']} | {r['concurrency']} | {cells} |")
    notes = [(t["name"], n) for t in doc["targets"] for n in t.get("notes", [])]
    notes += [(t["name"], "recompilations during the run: must be 0") for t in doc["targets"]
              if isinstance(t.get("recompilations"), (int, float)) and t["recompilations"] > 0]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {name}: {note}" for name, note in notes]
    return "\n".join(lines) + "\n"


def write_markdown(out_dir: Path, doc: dict[str, Any]) -> Path:
    path = out_dir / "summary.md"
    path.write_text(markdown(doc))
    return path


def ratio_lines(doc: dict[str, Any]) -> list[str]:
    """Console form of the ratios."""
    return [
        f"{r['target']} / {r['baseline']} @ concurrency {r['concurrency']}: "
        + ", ".join(f"{label} {_f(r[label], digits=2)}x" for _, _, label in RATIO_METRICS)
        for r in doc.get("ratios", [])
    ]
