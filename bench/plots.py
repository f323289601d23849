"""PNG plots: latency CDFs per bucket (one file per server), throughput and TTFT against concurrency.

matplotlib is imported lazily with the Agg backend (no display); without it the report has no plots
and says so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.runner import TargetRun
from bench.stats import group_by_bucket


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "server"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    # start the staircase at zero so a single-request bucket still draws a visible step
    return [xs[0], *xs], [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]


def latency_cdfs(plt: Any, out_dir: Path, target: TargetRun) -> Path | None:
    """Rows: concurrency levels; columns: TTFT and end-to-end latency; one line per bucket."""
    if not target.levels:
        return None
    rows = len(target.levels)
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.2 * rows), squeeze=False)
    for row, run in enumerate(target.levels):
        ok = [r for r in run.results if r.ok]
        for col, (label, key) in enumerate((("TTFT (ms)", "ttft"), ("end-to-end latency (s)", "e2e"))):
            ax = axes[row][col]
            scale = 1e3 if key == "ttft" else 1.0
            for bucket, group in group_by_bucket(ok).items():
                values = [getattr(r, key) * scale for r in group if getattr(r, key) is not None]
                if values:
                    xs, ys = _cdf(values)
                    ax.step(xs, ys, where="post", label=f"bucket {bucket} (n={len(values)})")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.set_title(f"{target.name}, concurrency {run.concurrency}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"latency_cdf_{_safe(target.name)}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _vs_concurrency(plt: Any, out_dir: Path, targets: list[TargetRun], kind: str) -> Path | None:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    drawn = False
    ticks: set[int] = set()
    for i, t in enumerate(targets):
        color = f"C{i}"
        levels = t.summary.get("levels") or []
        xs = [lv["concurrency"] for lv in levels]
        ticks.update(xs)
        if kind == "throughput":
            ys = [lv["output_tokens_per_s"] for lv in levels]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, marker="o", color=color, label=t.name)
                drawn = True
            continue
        for q, style in (("p50", "-"), ("p99", "--")):
            ys = [lv["ttft"][q] * 1e3 if lv["ttft"][q] is not None else None for lv in levels]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{t.name} {q}")
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(c) for c in sorted(ticks)])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (closed-loop clients)")
    ax.set_ylabel("output tokens/s" if kind == "throughput" else "TTFT (ms)")
    ax.set_title("Throughput vs concurrency" if kind == "throughput" else "TTFT vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{kind}_vs_concurrency.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(out_dir: Path, targets: list[TargetRun]) -> tuple[list[Path], str | None]:
    """The PNG files written, and why none were when matplotlib is missing."""
    try:
        plt = _pyplot()
    except ImportError:
        return [], "matplotlib is not installed: no plots (pip install matplotlib)"
    paths = [latency_cdfs(plt, out_dir, t) for t in targets]
    paths += [_vs_concurrency(plt, out_dir, targets, kind) for kind in ("throughput", "ttft")]
    return [p for p in paths if p is not None], None
