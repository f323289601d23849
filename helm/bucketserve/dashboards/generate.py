"""Generates bucketserve.json, the chart's Grafana dashboard: `python helm/bucketserve/dashboards/generate.py`.

The JSON is committed (the chart ships it as a ConfigMap); tests/helm checks it equals this script's output, so edit
here and regenerate. Every query filters on the `namespace` and `pod` variables; both default to All (".*"), which
also matches series scraped without those labels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEL = 'namespace=~"$namespace",pod=~"$pod"'
RATE = "$__rate_interval"
QUANTILES = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))
WIDTH = 24
OUTPUT = Path(__file__).with_name("bucketserve.json")

Panel = dict[str, Any]


def target(expr: str, legend: str = "", *, instant: bool = False, ref: int = 0) -> dict[str, Any]:
    t: dict[str, Any] = {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend or "__auto",
        "refId": chr(ord("A") + ref),
    }
    if instant:
        t.update({"instant": True, "range": False, "format": "table"})
    return t


def quantile_targets(histogram: str, by: str = "") -> list[dict[str, Any]]:
    """p50/p90/p99 of a histogram, per `by` label when given (histogram_quantile over the _bucket series)."""
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        target(
            f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{SEL}}}[{RATE}])))",
            f"{name}{suffix}",
            ref=i,
        )
        for i, (q, name) in enumerate(QUANTILES)
    ]


def timeseries(title: str, targets: list[dict[str, Any]], unit: str, description: str = "") -> Panel:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 5, "showPoints": "never"}},
                        "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": targets,
    }


def stat(title: str, expr: str, unit: str, description: str = "", *, red_from: float | None = None) -> Panel:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_from is not None:
        steps.append({"color": "red", "value": red_from})
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "background", "graphMode": "none", "textMode": "value"},
        "targets": [target(expr)],
    }


def rate_sum(counter: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({counter}{{{SEL}}}[{RATE}]))"


def overview() -> list[Panel]:
    return [
        stat("Ready pods", f"sum(bucketserve_ready{{{SEL}}})", "short", "pods whose graphs are all warmed"),
        stat("Graphs ready", f"sum(bucketserve_graphs_ready{{{SEL}}}) / sum(bucketserve_graphs{{{SEL}}})",
             "percentunit", "warmed graphs / graphs in the bucket table, over all pods"),
        stat("Recompilations", f"sum(bucketserve_recompilations_total{{{SEL}}}) or vector(0)", "short",
             "compilations after warm-up; anything but 0 means a shape escaped the bucket table", red_from=1),
        stat("Slowest warm-up", f"max(bucketserve_warmup_seconds{{{SEL}}})", "s", "load + warm-up of the slowest pod"),
        stat("Generation tokens/s", rate_sum("bucketserve_generation_tokens_total"), "short"),
        stat("Requests waiting", f"sum(bucketserve_requests_waiting{{{SEL}}})", "short", "the autoscaling signal"),
    ]


def latency() -> list[Panel]:
    return [
        timeseries("Time to first token by bucket",
                   quantile_targets("bucketserve_time_to_first_token_seconds", "bucket"),
                   "s", "arrival to first token, per prompt-length bucket"),
        timeseries("Inter-token latency", quantile_targets("bucketserve_inter_token_latency_seconds"), "s"),
        timeseries("Request duration by bucket",
                   quantile_targets("bucketserve_request_duration_seconds", "bucket"), "s"),
        timeseries("Queue wait", quantile_targets("bucketserve_queue_wait_seconds"), "s", "arrival to prefill"),
        timeseries("Prefill step", quantile_targets("bucketserve_prefill_seconds"), "s"),
        timeseries("Decode step", quantile_targets("bucketserve_decode_step_seconds"), "s"),
        timeseries("Mixed step", quantile_targets("bucketserve_mixed_step_seconds"), "s",
                   "decoding rows and prompt tokens in one graph call"),
        timeseries("Decode stall behind prefill", quantile_targets("bucketserve_decode_stall_seconds"), "s",
                   "decoding rows waiting for one prefill or chunk step (chunked prefill bounds it)"),
        timeseries("Prefill chunks per request", quantile_targets("bucketserve_prefill_chunks"), "short"),
    ]


def throughput() -> list[Panel]:
    return [
        timeseries("Generation throughput", [
            target(rate_sum("bucketserve_generation_tokens_total"), "tokens/s"),
            target(rate_sum("bucketserve_generation_tokens_total", "pod"), "{{pod}}", ref=1),
            target(rate_sum("bucketserve_mixed_decode_rows_total"), "decoded in mixed steps", ref=2),
        ], "short"),
        timeseries("Requests/s by status", [target(rate_sum("bucketserve_requests_total", "endpoint, status"),
                                                   "{{endpoint}} {{status}}")], "reqps"),
        timeseries("Requests/s by bucket", [target(rate_sum("bucketserve_bucket_requests_total", "bucket"),
                                                   "{{bucket}}")], "reqps"),
        timeseries("Rejected, aborted, over limit", [
            target(rate_sum("bucketserve_requests_rejected_total", "reason"), "rejected {{reason}}"),
            target(rate_sum("bucketserve_requests_aborted_total", "reason"), "aborted {{reason}}", ref=1),
            target(rate_sum("bucketserve_requests_over_limit_total"), "over limit", ref=2),
        ], "reqps"),
        timeseries("Finished requests/s by reason", [target(rate_sum("bucketserve_requests_finished_total",
                                                                     "finish_reason"), "{{finish_reason}}")], "reqps"),
        timeseries("Output tokens per request", [target(
            f"{rate_sum('bucketserve_generation_tokens_total')} / {rate_sum('bucketserve_requests_finished_total')}",
            "mean")], "short"),
    ]


def queue() -> list[Panel]:
    return [
        timeseries("Queue and slots", [
            target(f"sum(bucketserve_requests_waiting{{{SEL}}})", "waiting"),
            target(f"sum(bucketserve_requests_running{{{SEL}}})", "running", ref=1),
            target(f"sum(bucketserve_slots_free{{{SEL}}})", "free slots", ref=2),
        ], "short"),
        timeseries("Requests waiting per pod", [target(f"sum by (pod) (bucketserve_requests_waiting{{{SEL}}})",
                                                       "{{pod}}")], "short"),
    ]


def shapes() -> list[Panel]:
    padding = rate_sum("bucketserve_padding_tokens_total")
    prompt = rate_sum("bucketserve_prompt_tokens_total")
    return [
        timeseries("Padding ratio", [target(f"{padding} / ({prompt} + {padding})", "padding / (prompt + padding)")],
                   "percentunit", "share of computed token positions that are padding up to a bucket"),
        timeseries("Padding tokens/s by phase", [target(rate_sum("bucketserve_padding_tokens_total", "phase"),
                                                        "{{phase}}")], "short"),
        timeseries("Batch occupancy", quantile_targets("bucketserve_batch_occupancy") + [
            target(f"{rate_sum('bucketserve_batch_occupancy_sum')} / {rate_sum('bucketserve_batch_occupancy_count')}",
                   "mean", ref=3),
        ], "percentunit", "active rows / batch bucket per decode step"),
        timeseries("Prompt length", quantile_targets("bucketserve_prompt_length"), "short"),
        timeseries("Prefix cache hit rate", [
            target(f"{rate_sum('bucketserve_prefix_cache_hits_total')} / "
                   f"{rate_sum('bucketserve_prefix_cache_queries_total')}", "hits / queries"),
        ], "percentunit", "share of started prompts' tokens whose K/V a slot already held (not computed again)"),
        timeseries("Speculative decoding acceptance", [
            target(f"{rate_sum('bucketserve_spec_decode_num_accepted_tokens_total')} / "
                   f"{rate_sum('bucketserve_spec_decode_num_draft_tokens_total')}", "accepted / drafts"),
        ], "percentunit", "share of n-gram draft tokens that verify steps accepted (each one a step saved)"),
    ]


def compilation() -> list[Panel]:
    return [
        timeseries("Recompilations (should stay 0)", [
            target(f"sum by (reason) (increase(bucketserve_recompilations_total{{{SEL}}}[{RATE}]))", "{{reason}}"),
        ], "short"),
        timeseries("Graph compilations by phase", [
            target(f"sum by (phase) (bucketserve_graph_compilations_total{{{SEL}}})", "{{phase}}"),
        ], "short"),
        timeseries("Compilations per tensor-parallel rank", [
            target(f"max by (rank, phase) (bucketserve_rank_compilations{{{SEL}}})", "rank {{rank}} {{phase}}"),
        ], "short", "each rank's compilations; serving must stay 0 on every rank"),
        timeseries("Compile seconds", quantile_targets("bucketserve_compile_seconds") + [
            target(f"sum(bucketserve_compile_seconds_sum{{{SEL}}})", "total", ref=3),
        ], "s"),
        timeseries("Compile cache", [
            target(f"sum(bucketserve_compile_cache_hits_total{{{SEL}}})", "hits"),
            target(f"sum(bucketserve_compile_cache_misses_total{{{SEL}}})", "misses", ref=1),
            target(f"sum by (reason) (bucketserve_compile_artifacts_rejected_total{{{SEL}}})",
                   "rejected ({{reason}})", ref=2),
        ], "short", "graphs found in / missing from the compile cache at warm-up; rejected: saved artifacts "
                    "found corrupt or stale and rebuilt"),
        timeseries("Warm-up seconds per pod", [
            target(f"max by (pod) (bucketserve_warmup_seconds{{{SEL}}})", "{{pod}} seconds"),
        ], "s"),
        timeseries("Graphs warmed", [
            target(f"sum by (pod) (bucketserve_graphs_ready{{{SEL}}})", "{{pod}} ready"),
            target(f"sum by (pod) (bucketserve_graphs{{{SEL}}})", "{{pod}} total", ref=1),
        ], "short"),
        {
            "type": "table",
            "title": "Build info",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "targets": [target(f"bucketserve_info{{{SEL}}}", instant=True)],
            "fieldConfig": {"defaults": {}, "overrides": []},
            "options": {"showHeader": True},
        },
    ]


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(sections: list[tuple[str, list[Panel], int]]) -> list[Panel]:
    """Rows of equally wide panels; ids and gridPos assigned in order."""
    panels: list[Panel] = []
    y = 0
    for title, items, per_line in sections:
        header = row(title)
        header["gridPos"] = {"x": 0, "y": y, "w": WIDTH, "h": 1}
        panels.append(header)
        y += 1
        width = WIDTH // per_line
        height = 4 if items and items[0]["type"] == "stat" else 8
        for index, panel in enumerate(items):
            panel["gridPos"] = {"x": (index % per_line) * width, "y": y + (index // per_line) * height,
                                "w": width, "h": height}
            panels.append(panel)
        y += ((len(items) + per_line - 1) // per_line) * height
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
    return panels


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "bucketserve",
        "title": "bucketserve",
        "description": "Static-shape LLM serving: latency per bucket, throughput, queue, padding, compilation",
        "tags": ["bucketserve", "llm", "neuron"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            variable("namespace", "label_values(bucketserve_ready, namespace)"),
            variable("pod", 'label_values(bucketserve_ready{namespace=~"$namespace"}, pod)'),
        ]},
        "panels": layout([
            ("Overview", overview(), 6),
            ("Latency", latency(), 3),
            ("Throughput", throughput(), 3),
            ("Queue", queue(), 2),
            ("Shapes and padding", shapes(), 2),
            ("Compilation and warm-up", compilation(), 3),
        ]),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
