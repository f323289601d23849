"""PNG plots for `bucketserve plan` (matplotlib, headless). Imported only when --plot-dir is given,
so the planner itself runs without matplotlib."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

from buckets.planner import Evaluation, PlanResult  # noqa: E402


def _log_bins(lo: int, hi: int, count: int = 60) -> list[float]:
    # Prompt lengths span orders of magnitude (long-tailed), so equal-width bins on a log axis.
    a, b = math.log(max(lo, 1) * 0.95), math.log(hi * 1.05)
    return [math.exp(a + (b - a) * i / count) for i in range(count + 1)]


def plot_lengths(path: Path, hist: Mapping[int, int], current: Evaluation, plan: PlanResult) -> None:
    """Length histogram with the current (dashed) and proposed (solid) bucket boundaries."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    values = list(hist)
    hi = max(values + list(current.buckets) + list(plan.buckets))
    ax.hist(values, bins=_log_bins(min(values), hi), weights=list(hist.values()), color="#9ab", label="prompts")
    ax.set_xscale("log")
    for i, b in enumerate(current.buckets):
        ax.axvline(b, color="#444", linestyle="--", linewidth=1,
                   label=f"current ({len(current.buckets)}): {_pct(current.padding_ratio)} padding" if i == 0 else None)
    for i, b in enumerate(plan.buckets):
        ax.axvline(b, color="#c22", linewidth=1.4,
                   label=f"proposed ({len(plan.buckets)}): {_pct(plan.evaluation.padding_ratio)} padding"
                   if i == 0 else None)
    ax.set_xlabel("prompt length (tokens, log scale)")
    ax.set_ylabel("prompts")
    ax.set_title("Prompt lengths and bucket boundaries")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_padding_curve(path: Path, current: Evaluation, plan: PlanResult) -> None:
    """Padding ratio of the cost-optimal plan for K = 1..K_max, with the current table marked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ks = list(range(1, len(plan.by_k) + 1))
    ax.plot(ks, [100 * e.padding_ratio for e in plan.by_k], marker="o", color="#c22", label="planned")
    ax.scatter([len(current.buckets)], [100 * current.padding_ratio], marker="x", s=80, color="#444",
               label="current", zorder=3)
    ax.set_xlabel("length buckets K")
    ax.set_ylabel("padding ratio (% of computed prefill tokens)")
    ax.set_xticks(ks)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Padding vs number of length buckets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(plot_dir: Path, hist: Mapping[int, int], current: Evaluation, plan: PlanResult) -> list[Path]:
    plot_dir.mkdir(parents=True, exist_ok=True)
    lengths_png = plot_dir / "lengths.png"
    curve_png = plot_dir / "padding_vs_buckets.png"
    plot_lengths(lengths_png, hist, current, plan)
    plot_padding_curve(curve_png, current, plan)
    return [lengths_png, curve_png]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"
