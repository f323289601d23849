"""The Grafana dashboard: valid JSON that its generator reproduces, every bucketserve_* series it queries is one
the server exports (with labels that metric has), every exported metric has a panel, and the chart ships it as
a sidecar-discoverable ConfigMap."""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType
from typing import Any, Iterator

import pytest
from chart_support import CHART_DIR, SCENARIOS, Render, one
from metric_names import HISTOGRAMS, METRIC_NAMES, METRICS, PREFIX, metric_of

DASHBOARD = CHART_DIR / "dashboards" / "bucketserve.json"
SERIES = re.compile(rf"\b{PREFIX}[a-z0-9_]+")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
SCRAPE_LABELS = {"pod", "namespace", "instance", "job"}  # added by Prometheus, not by the server


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["definition"]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboard_generate", CHART_DIR / "dashboards" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_is_what_the_generator_writes() -> None:
    assert DASHBOARD.read_text() == generator().render(), "run python helm/bucketserve/dashboards/generate.py"


def test_dashboard_structure(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "bucketserve" and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "pod"} <= variables


def test_every_queried_series_is_exported(dashboard: dict[str, Any]) -> None:
    unknown = {s for expr in expressions(dashboard) for s in SERIES.findall(expr) if metric_of(s) is None}
    assert unknown == set(), f"the dashboard queries series the server does not export: {sorted(unknown)}"


def test_every_exported_metric_has_a_panel(dashboard: dict[str, Any]) -> None:
    used = {metric_of(s) for expr in expressions(dashboard) for s in SERIES.findall(expr)}
    assert set(METRIC_NAMES) - used == set()


def test_groupings_use_labels_the_metrics_have(dashboard: dict[str, Any]) -> None:
    for expr in expressions(dashboard):
        metrics = {metric_of(s) for s in SERIES.findall(expr)}
        labels = set(SCRAPE_LABELS)
        for metric in metrics:
            assert metric is not None
            labels |= set(METRICS[metric][1]) | ({"le"} if metric in HISTOGRAMS else set())
        for group in GROUPING.findall(expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= labels, f"{expr}: no label {used - labels}"


def test_quantiles_come_from_bucket_series(dashboard: dict[str, Any]) -> None:
    quantiles = [e for e in expressions(dashboard) if "histogram_quantile" in e]
    assert quantiles
    for expr in quantiles:
        assert re.search(r"sum by \(le\b", expr), expr
        assert all(s.endswith("_bucket") for s in SERIES.findall(expr)), expr


def titled(dashboard: dict[str, Any], fragment: str) -> dict[str, Any]:
    """The one panel with this exact title, else the one whose title contains it."""
    matches = [p for p in panels(dashboard) if p["title"] == fragment]
    matches = matches or [p for p in panels(dashboard) if fragment.lower() in p["title"].lower()]
    assert len(matches) == 1, f"one panel titled like {fragment!r}, found {len(matches)}"
    return matches[0]


@pytest.mark.parametrize(("title", "histogram", "by_bucket"), [
    ("time to first token", "bucketserve_time_to_first_token_seconds", True),
    ("inter-token latency", "bucketserve_inter_token_latency_seconds", False),
    ("request duration", "bucketserve_request_duration_seconds", True),
])
def test_latency_panels_show_p50_p90_p99(dashboard: dict[str, Any], title: str, histogram: str,
                                         by_bucket: bool) -> None:
    exprs = [t["expr"] for t in titled(dashboard, title)["targets"]]
    for quantile in ("0.5", "0.9", "0.99"):
        (expr,) = [e for e in exprs if e.startswith(f"histogram_quantile({quantile},")]
        assert f"{histogram}_bucket" in expr
        assert ("bucket)" in expr) == by_bucket


def test_required_panels(dashboard: dict[str, Any]) -> None:
    def exprs(fragment: str) -> str:
        return " ".join(t["expr"] for t in titled(dashboard, fragment)["targets"])

    ratio = exprs("padding ratio")
    assert "bucketserve_padding_tokens_total" in ratio and "bucketserve_prompt_tokens_total" in ratio
    assert re.search(r"/ \(.*prompt_tokens_total.*\+.*padding_tokens_total", ratio), ratio
    assert "rate(bucketserve_generation_tokens_total" in exprs("generation throughput")
    assert "rate(bucketserve_requests_total" in exprs("requests/s by status")
    queue = exprs("queue and slots")
    for gauge in ("requests_waiting", "requests_running", "slots_free"):
        assert f"bucketserve_{gauge}" in queue
    assert "bucketserve_batch_occupancy" in exprs("batch occupancy")
    assert "bucketserve_recompilations_total" in exprs("recompilations (should stay 0)")
    assert "bucketserve_compile_seconds" in exprs("compile seconds")
    assert "bucketserve_warmup_seconds" in exprs("warm-up seconds per pod")
    recompilations = titled(dashboard, "Recompilations")  # the stat turns red on the first one
    steps = recompilations["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1] == {"color": "red", "value": 1}


def test_chart_ships_the_dashboard(render: Render) -> None:
    config_map = one(render(SCENARIOS["dashboard"]), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(config_map["data"]["bucketserve.json"]) == json.loads(DASHBOARD.read_text())
    assert not [m for m in render() if m["kind"] == "ConfigMap"], "the dashboard is optional"
