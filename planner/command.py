"""`bucketserve plan`: fit prompt-length buckets to recorded traffic under a graph budget.

Reads prompt lengths (a lengths file, a JSONL prompts file tokenized with the model's tokenizer, or the
`bucketserve_prompt_length` histogram of a running server), runs the exact planner in
`buckets.planner`, prints the current and proposed buckets side by side, and writes a bucket table
that `bucketserve serve --buckets-file` accepts. See docs/planner.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from buckets import BucketError, BucketTable, flag_sizes
from buckets.planner import Evaluation, Lengths, PlanResult, default_alpha, evaluate, plan_buckets, to_histogram
from planner.inputs import (
    DEFAULT_METRIC,
    PlanInputError,
    histogram_from_metrics,
    read_lengths_file,
    read_prompts_file,
    scrape_metrics,
)

__all__ = ["PlanInputError", "add_arguments", "padding_report", "read_lengths_file", "run"]

DEFAULT_LIMIT = 2048  # same as ServerSettings.max_model_len


# -- reports --------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _graphs(table: BucketTable, n_lengths: int) -> str:
    """Decode (batch x KV buckets) and prefill graphs; the few sampling and chunk graphs are not counted."""
    prefill = n_lengths * len(table.prefill_batch_sizes)
    decode = len(table.batch_sizes) * len(table.kv_lengths)
    return f"{decode + prefill} ({decode} decode + {prefill} prefill)"


def comparison(table: BucketTable, current: Evaluation, proposed: Evaluation) -> str:
    """The side-by-side table printed by `plan`."""
    rows = [
        ("", "current", "proposed"),
        ("length buckets", str(len(current.buckets)), str(len(proposed.buckets))),
        ("graphs", _graphs(table, len(current.buckets)), _graphs(table, len(proposed.buckets))),
        ("padding ratio (pad/computed)", _pct(current.padding_ratio), _pct(proposed.padding_ratio)),
        ("pad tokens per real token", f"{current.pad_per_real:.3f}", f"{proposed.pad_per_real:.3f}"),
        ("expected cost per prompt", f"{current.mean_cost:.1f}", f"{proposed.mean_cost:.1f}"),
        ("prompts above largest bucket", str(current.uncovered), str(proposed.uncovered)),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
    lines.append(f"current buckets:  {','.join(map(str, current.buckets))}")
    lines.append(f"proposed buckets: {','.join(map(str, proposed.buckets))}")
    return "\n".join(lines)


def padding_report(table: BucketTable, lengths: Lengths) -> str:
    """One paragraph for the server log at start-up: the padding this table costs on the given
    lengths (a list, or a histogram such as `read_lengths_file` returns), and what the planner would
    give with the same number of length buckets. Raises BucketError on a length < 1."""
    hist = to_histogram(lengths)
    alpha = default_alpha(table.context_length)
    current = evaluate(table.lengths, hist, alpha=alpha)
    text = (
        f"bucket padding on {sum(hist.values())} recorded prompts: {_pct(current.padding_ratio)} of computed "
        f"prefill tokens are padding with buckets {','.join(map(str, table.lengths))}"
    )
    if current.uncovered:
        text += f"; {current.uncovered} prompts are longer than the largest bucket {table.max_length}"
    try:
        plan = plan_buckets(hist, len(table.lengths), alpha=alpha, limit=table.context_length)
    except BucketError:
        return text
    if plan.evaluation.total_cost < current.total_cost:
        text += (
            f"; planned buckets {','.join(map(str, plan.buckets))} would give "
            f"{_pct(plan.evaluation.padding_ratio)} (run `bucketserve plan --lengths-file ...`)"
        )
    return text


# -- command ------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths-file", help="prompt lengths: one integer per line, or a JSON list")
    src.add_argument("--prompts-file", help="JSONL of {'prompt': ...} or {'messages': [...]}; needs --model")
    src.add_argument("--metrics-url", help="a running server's /metrics URL (uses its prompt-length histogram)")
    parser.add_argument("--model", help="model dir whose tokenizer counts --prompts-file tokens")
    parser.add_argument("--metric-name", default=DEFAULT_METRIC, help="histogram to read from --metrics-url")
    parser.add_argument("--max-graphs", "--max-buckets", dest="max_graphs", type=int, default=None, metavar="K",
                        help="most length buckets to propose (each costs one graph per prefill batch size); "
                        "default: as many as the current table")
    parser.add_argument("--buckets", type=flag_sizes, default=None,
                        help="current length buckets, e.g. 64,128,256 (default: powers of two from 64 to the limit)")
    parser.add_argument("--buckets-file", default=None, help="current bucket table JSON (keeps its batch sizes)")
    parser.add_argument("--batch-sizes", type=flag_sizes, default=(1, 2, 4, 8))
    parser.add_argument("--prefill-batch-sizes", type=flag_sizes, default=(1,))
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"context limit; longer prompts are reported and excluded (default: the buckets "
                        f"file's context length, else {DEFAULT_LIMIT})")
    parser.add_argument("--alpha", type=float, default=None,
                        help="weight of the attention term in cost(L) = L + alpha*L^2 (default 1/max-model-len)")
    parser.add_argument("--cover-model-limit", action="store_true",
                        help="make the largest bucket the context limit, not the largest observed length")
    parser.add_argument("--multiple-of", type=int, default=1, help="only propose buckets that are multiples of this")
    parser.add_argument("--compile-seconds-per-graph", type=float, default=None)
    parser.add_argument("--compile-budget", type=float, default=None,
                        help="seconds of warm-up compile allowed for prefill graphs; caps the length buckets at "
                        "floor(budget / (seconds-per-graph * prefill batch sizes))")
    parser.add_argument("--kv-buckets", dest="num_kv_buckets", type=int, default=0, metavar="K",
                        help="also fit K decode KV-length buckets to prompt + --output-tokens lengths (the last is "
                        "the context limit); 0 keeps the current table's KV buckets")
    parser.add_argument("--output-tokens", type=int, default=64,
                        help="tokens generated per request, added to each prompt length for --kv-buckets")
    parser.add_argument("--out", default=None, help="write the proposed bucket table here (JSON)")
    parser.add_argument("--plot-dir", default=None, help="write lengths.png and padding_vs_buckets.png here")


def _current_table(args: argparse.Namespace) -> BucketTable:
    if args.max_model_len is not None and args.max_model_len < 1:
        raise PlanInputError(f"--max-model-len must be positive, got {args.max_model_len}")
    if args.buckets_file:
        table = BucketTable.load(args.buckets_file)
        if args.max_model_len is None:
            return table
        limit = args.max_model_len
        return BucketTable(tuple(b for b in table.lengths if b <= limit) or (limit,), table.batch_sizes,
                           table.prefill_batch_sizes, limit)
    limit = args.max_model_len or DEFAULT_LIMIT
    if args.buckets:
        return BucketTable(args.buckets, args.batch_sizes, args.prefill_batch_sizes, max(limit, args.buckets[-1]))
    return BucketTable.default(limit, batch_sizes=args.batch_sizes, prefill_batch_sizes=args.prefill_batch_sizes)


def _max_buckets(args: argparse.Namespace, table: BucketTable) -> int:
    k: int = len(table.lengths) if args.max_graphs is None else args.max_graphs
    s, t = args.compile_seconds_per_graph, args.compile_budget
    if (s is None) != (t is None):
        raise PlanInputError("--compile-seconds-per-graph and --compile-budget go together")
    if s is not None and t is not None:
        if s <= 0 or t <= 0:
            raise PlanInputError(f"compile budget needs positive values, got {s} s/graph and {t} s")
        cap = math.floor(t / (s * len(table.prefill_batch_sizes)))
        if cap < 1:
            raise PlanInputError(f"a compile budget of {t} s does not fit one length bucket at {s} s per graph "
                                 f"x {len(table.prefill_batch_sizes)} prefill batch sizes")
        k = min(k, cap)
    if k < 1:
        raise PlanInputError(f"--max-graphs must be positive, got {k}")
    return k


def load_lengths(args: argparse.Namespace, limit: int) -> dict[int, int]:
    if args.lengths_file:
        return read_lengths_file(args.lengths_file)
    if args.prompts_file:
        if not args.model:
            raise PlanInputError("--prompts-file needs --model DIR for the tokenizer")
        return read_prompts_file(args.prompts_file, args.model)
    return histogram_from_metrics(scrape_metrics(args.metrics_url), limit, args.metric_name)


def run(args: argparse.Namespace) -> int:
    try:
        table = _current_table(args)
        limit = table.context_length
        k = _max_buckets(args, table)
        hist: Lengths = load_lengths(args, limit)
        alpha = default_alpha(limit) if args.alpha is None else args.alpha
        plan = plan_buckets(hist, k, alpha=alpha, limit=limit, cover_limit=args.cover_model_limit,
                            multiple_of=args.multiple_of)
    except (OSError, PlanInputError, BucketError, ValueError) as exc:
        print(f"bucketserve plan: {exc}", file=sys.stderr)
        return 2
    served = {n: c for n, c in to_histogram(hist).items() if n <= limit}
    current = evaluate(table.lengths, served, alpha=alpha)
    print(summary(plan, served, alpha, limit, args.cover_model_limit))
    print(comparison(table, current, plan.evaluation))
    kv = table.kv_lengths
    if args.num_kv_buckets:
        try:
            kv = plan_kv_buckets(served, args.num_kv_buckets, args.output_tokens, limit)
        except (BucketError, ValueError) as exc:
            print(f"bucketserve plan: {exc}", file=sys.stderr)
            return 2
        print(f"proposed KV buckets: {','.join(map(str, kv))} (current {','.join(map(str, table.kv_lengths))})")
    if args.out:
        proposed = BucketTable(plan.buckets, table.batch_sizes, table.prefill_batch_sizes, limit, kv)
        proposed.save(args.out)
        print(f"wrote {args.out} (serve it with `bucketserve serve --buckets-file {args.out}`)")
    if args.plot_dir:
        try:
            from planner.plots import write_plots
        except ImportError as exc:
            print(f"bucketserve plan: plots need matplotlib (pip install matplotlib): {exc}", file=sys.stderr)
            return 1
        for path in write_plots(Path(args.plot_dir), served, current, plan):
            print(f"wrote {path}")
    return 0


def plan_kv_buckets(prompts: Mapping[int, int], k: int, output_tokens: int, limit: int) -> tuple[int, ...]:
    """K KV-length buckets fitted by the exact planner to each request's final length (prompt + output,
    capped at the context): a decode step pays for its bucket, so the same padding objective applies. The
    last bucket is always the context limit (every live row needs a graph). Ignores that the longest row
    of a batch picks the bucket, so it favours the distribution's upper part less than the server does."""
    if k < 1 or output_tokens < 0:
        raise ValueError(f"--kv-buckets must be positive and --output-tokens >= 0, got {k} and {output_tokens}")
    finals: dict[int, int] = {}
    for n, count in prompts.items():
        total = min(n + output_tokens, limit)
        finals[total] = finals.get(total, 0) + count
    plan = plan_buckets(finals, k, alpha=default_alpha(limit), limit=limit, cover_limit=True)
    return tuple(plan.buckets)


def summary(plan: PlanResult, served: Mapping[int, int], alpha: float, limit: int, cover: bool) -> str:
    n = sum(served.values())
    lines = [f"{n} prompts, {len(served)} distinct lengths, max {max(served)} tokens (limit {limit})"]
    if plan.over_limit:
        lines.append(f"over limit: {plan.over_limit} prompts longer than {limit} tokens, excluded")
    lines.append(f"cost model: cost(L) = L + alpha*L^2 per prompt in bucket L, alpha = {alpha:.6g}")
    top = "the context limit" if cover else "the largest observed length (prompts longer than it will be rejected)"
    lines.append(f"at most {plan.max_buckets} length buckets; the largest is {top}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bucketserve plan", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
