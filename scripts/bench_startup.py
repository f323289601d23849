"""Start-up time of `bucketserve serve`, cold and from a filled cache, per graph and total, beside the decode
speed of the graphs it produced (a faster compile that makes slower graphs would show here).

For each configuration: an empty cache directory, a cold start (process start -> /ready 200), one greedy
64-token stream (decode tokens/s after the first token), stop; then a restart on the same cache, the same
stream, stop. Per-graph seconds come from the server's warm-up log lines.
Usage: python scripts/bench_startup.py [--configs float32,bfloat16,bfloat16:freeze] [--threads 1]
       [--compile-workers 0] [--restarts 1] [--keep-cache] [--out results/bench-startup]
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.servers import RunningServer, bucketserve_command  # noqa: E402

# "(compiled; 68.1 s in a builder process)": loaded here in the logged seconds, compiled by a builder
WARM_LINE = re.compile(r"warm-up (\d+)/(\d+) (\S+) ([\d.]+) s \((from cache|compiled)(?:; ([\d.]+) s in a builder)?")


def stream_tokens_per_second(url: str, tokens: int = 64) -> float:
    """Decode tokens/s of one greedy stream, after its first token."""
    body = {"prompt": "The history of the printing press", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0


def one_start(name: str, argv_extra: list[str], log: Path, threads: int) -> dict[str, Any]:
    cmd = bucketserve_command("default", threads, argv_extra, name=name)
    with RunningServer(cmd, log) as server:
        ready = server.wait_ready(3600, poll=0.1)
        tps = statistics.median(stream_tokens_per_second(cmd.url) for _ in range(3))
    graphs = [{"graph": m[3], "seconds": float(m[4]), "source": m[5],
               "builder_seconds": float(m[6]) if m[6] else None}
              for m in WARM_LINE.finditer(log.read_text(errors="replace"))]
    return {"ready_seconds": round(ready, 2), "decode_tokens_per_second": round(tps, 1), "graphs": graphs,
            "compiled": sum(g["source"] == "compiled" for g in graphs),
            "graph_seconds": round(sum(g["seconds"] for g in graphs), 2),
            "builder_graph_seconds": round(sum(g["builder_seconds"] or 0.0 for g in graphs), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile-workers", type=int, default=0)
    p.add_argument("--restarts", type=int, default=1, help="warm restarts per configuration (the median is reported)")
    p.add_argument("--keep-cache", action="store_true", help="reuse a filled cache: warm restarts only")
    p.add_argument("--out", default="results/bench-startup")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for config in args.configs.split(","):
        dtype, _, option = config.partition(":")
        cache = out.parent / f"startup-cache-{dtype}{'-' + option if option else ''}"
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
        extra = ["--dtype", dtype, "--compile-cache-dir", str(cache), "--compile-workers", str(args.compile_workers)]
        if option == "freeze":
            extra.append("--inductor-freezing")
        row: dict[str, Any] = {"config": config, "load_average": os.getloadavg()[0]}
        phases = (["cold"] if not args.keep_cache else []) + [f"warm{i}" for i in range(args.restarts)]
        for phase in phases:
            print(f"[startup] {config} {phase} ...", flush=True)
            row[phase] = one_start(f"bucketserve-{phase}", extra, out.parent / f"startup-{config.replace(':', '-')}-{phase}.log",
                                   args.threads)
            print(f"[startup] {config} {phase}: ready {row[phase]['ready_seconds']} s, "
                  f"{row[phase]['compiled']} compiled, {row[phase]['decode_tokens_per_second']} tok/s, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
        warm = sorted((row[p] for p in phases if p.startswith("warm")), key=lambda r: r["ready_seconds"])
        row["warm"] = warm[len(warm) // 2]
        row["warm_ready_all"] = [r["ready_seconds"] for r in warm]
        row.setdefault("cold", None)
        results.append(row)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = ["| config | graphs | cold: ready s | cold: graph s (sum) | warm: ready s | warm: graph s (sum) | "
             "warm: compiled | decode tok/s cold / warm |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, w = r["cold"] or {}, r["warm"]
        lines.append(f"| {r['config']} | {len(w['graphs'])} | {c.get('ready_seconds', '-')} | "
                     f"{c.get('graph_seconds', '-')} | {w['ready_seconds']} (of {r['warm_ready_all']}) | "
                     f"{w['graph_seconds']} | {w['compiled']} | "
                     f"{c.get('decode_tokens_per_second', '-')} / {w['decode_tokens_per_second']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
