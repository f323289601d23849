"""What a served run's engine did, step by step: the server's own `serve` command with every engine step recorded
(kind, rows sampled, token bucket, decoding rows and prompt tokens of a mixed step, batch bucket of a decode step,
start and end), then a summary of a window of the trace. The evidence for "where a level's seconds go": how many
steps of each kind ran, how many rows each carried and what each cost, under the real load rather than alone.

    python scripts/trace_steps.py serve --trace /tmp/trace.jsonl -- --model default --num-threads 1 --dtype bfloat16
    bucketserve bench --url http://127.0.0.1:8000 --concurrency 16 ...   (any load, from another shell)
    python scripts/trace_steps.py summary /tmp/trace.jsonl [--after 1.5] [--steps]

`summary` reads the trace: `--after S` skips the first S seconds (a bench's warm-up request), `--steps` prints
every step. The recording wraps the engine's step method from outside (server code is unchanged); a step's
seconds include its sampling and token delivery, as the engine thread spends them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, from any cwd


def record(step: Any, t0: float, t1: float, active: int, generated: int) -> dict[str, Any]:
    """One step as a JSON-able dict (buckets.steps types, duck-typed by their fields); `generated`: the tokens it gave
    its rows (a verify step's accepted drafts too)."""
    rec: dict[str, Any] = {"t0": t0, "t1": t1, "kind": type(step).__name__, "rows": len(step.sampling_seqs),
                           "active": active, "generated": generated}
    if hasattr(step, "pieces"):  # MixedStep
        rec.update(tokens=step.tokens, decode=len(step.decode), prompt=sum(p.num_tokens for p in step.pieces),
                   drafts=step.num_drafts)
    elif hasattr(step, "batch"):  # DecodeStep, PrefillStep
        rec["batch"] = step.batch
    return rec


def serve(trace: Path, serve_args: list[str]) -> int:
    """Run `bucketserve serve <serve_args>` in this process, appending one JSON line per engine step to `trace`."""
    import server.engine.engine as engine_module
    from server.cli import main

    out: TextIO = trace.open("w")
    run = engine_module.Engine._run

    def traced(self: Any, step: Any, prompts: dict[str, list[int]]) -> None:
        before = sum(seq.num_generated for seq in step.sampling_seqs)
        t0 = time.monotonic()
        run(self, step, prompts)
        t1 = time.monotonic()
        with self._lock:
            active = len(self._active)
        generated = sum(seq.num_generated for seq in step.sampling_seqs) - before
        out.write(json.dumps(record(step, t0, t1, active, generated)) + "\n")
        out.flush()

    engine_module.Engine._run = traced  # type: ignore[method-assign]
    try:
        return main(["serve", *serve_args])
    finally:
        out.close()


def summary(trace: Path, after: float, steps: bool) -> None:
    recs = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    if not recs:
        raise SystemExit(f"{trace}: no steps recorded")
    start = recs[0]["t0"] + after
    recs = [r for r in recs if r["t0"] >= start]
    if not recs:
        raise SystemExit(f"{trace}: no steps after {after} s")
    span = recs[-1]["t1"] - recs[0]["t0"]
    busy = sum(r["t1"] - r["t0"] for r in recs)
    gave = sum(r.get("generated", r["rows"]) for r in recs)
    print(f"{len(recs)} steps over {span:.2f} s, engine busy {busy:.2f} s ({busy / span:.1%}), "
          f"{gave} tokens generated ({gave / span:.1f} a second)")
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        bucket = r.get("tokens", r.get("batch", ""))
        kind = "VerifyStep" if r.get("drafts") else r["kind"]  # a mixed step whose rows carry drafts
        groups[f"{kind} {bucket}"].append(r)
    print(f"{'step':22s} {'count':>5s} {'rows':>6s} {'decode':>6s} {'drafts':>6s} {'gave':>6s} {'prompt':>6s} "
          f"{'ms p50':>7s} {'ms mean':>7s} {'seconds':>7s} {'share':>6s}")
    for name, rs in sorted(groups.items(), key=lambda kv: -sum(r["t1"] - r["t0"] for r in kv[1])):
        ms = [(r["t1"] - r["t0"]) * 1e3 for r in rs]
        decode = statistics.mean(r.get("decode", r["rows"]) for r in rs)
        prompt = statistics.mean(r.get("prompt", 0) for r in rs)
        drafts = statistics.mean(r.get("drafts", 0) for r in rs)
        gave = statistics.mean(r.get("generated", r["rows"]) for r in rs)  # traces before the field: a token a row
        print(f"{name:22s} {len(rs):5d} {statistics.mean(r['rows'] for r in rs):6.1f} {decode:6.1f} {drafts:6.1f} "
              f"{gave:6.1f} {prompt:6.1f} "
              f"{statistics.median(ms):7.1f} {statistics.mean(ms):7.1f} {sum(ms) / 1e3:7.2f} "
              f"{sum(ms) / 1e3 / span:6.1%}")
    if steps:
        for r in recs:
            detail = (f"tokens {r['tokens']} decode {r['decode']} drafts {r.get('drafts', 0)} prompt {r['prompt']}"
                      if "tokens" in r
                      else f"batch {r.get('batch')} rows {r['rows']}")
            print(f"{r['t0'] - recs[0]['t0']:8.3f} {(r['t1'] - r['t0']) * 1e3:7.1f} ms  active {r['active']:3d}  "
                  f"{r['kind']:11s} {detail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve with every engine step recorded")
    s.add_argument("--trace", type=Path, required=True)
    s.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the arguments of `bucketserve serve`")
    m = sub.add_parser("summary", help="summarize a trace")
    m.add_argument("trace", type=Path)
    m.add_argument("--after", type=float, default=0.0, help="skip the first seconds of the trace")
    m.add_argument("--steps", action="store_true", help="print every step too")
    args = parser.parse_args()
    if args.command == "serve":
        rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        return serve(args.trace, rest)
    summary(args.trace, args.after, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
