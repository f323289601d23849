"""Fixtures for the Helm chart tests: the chart loaded through helm-python-sdk (Helm's Go SDK in a shared library,
no helm binary and no cluster) and rendering to parsed manifests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

# pytest 9 no longer puts a rootless conftest's directory on sys.path; the test modules import the helper
# modules next to this file (chart_support, metric_names) by their plain names.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from chart_support import CHART_DIR, NAMESPACE, RELEASE, Manifest, Render, parse_manifests  # noqa: E402


@pytest.fixture(scope="session")
def default_values() -> dict[str, Any]:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


@pytest.fixture(scope="session")
def values_schema() -> dict[str, Any]:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert isinstance(schema, dict)
    return schema


@pytest.fixture(scope="session")
def helm() -> Any:
    """The helm_python module, with its native library loaded; skipped only when the package is unavailable."""
    module = pytest.importorskip(
        "helm_python", reason="helm-python-sdk is not installed (`.venv/bin/pip install helm-python-sdk`)"
    )
    try:
        module.helm_sdk_version()
    except (OSError, module.HelmLibraryError) as exc:  # pragma: no cover - only on platforms without the wheel
        pytest.skip(f"helm-python-sdk cannot load its Helm library here: {exc}")
    return module


@pytest.fixture(scope="session")
def chart(helm: Any) -> Iterator[Any]:
    loaded = helm.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def render(chart: Any) -> Render:
    """render(values) -> parsed manifests, as `helm template rel helm/bucketserve -n llm -f values` would print."""

    def _render(values: dict[str, Any] | None = None) -> list[Manifest]:
        return parse_manifests(chart.render(values, name=RELEASE, namespace=NAMESPACE))

    return _render
