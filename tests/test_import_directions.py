"""buckets/ is pure Python; models/ knows nothing of HTTP or buckets; only server/ touches Starlette,
uvicorn and prometheus-client."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "buckets": {"torch", "transformers", "models", "server", "starlette", "uvicorn", "prometheus_client", "numpy"},
    "models": {"server", "buckets", "starlette", "uvicorn", "prometheus_client", "pydantic", "httpx"},
    "bench": {"server", "models", "torch", "starlette", "uvicorn"},
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_directions(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files or package == "bench"
    for path in files:
        bad = imported_roots(path) & FORBIDDEN[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_web_stack_only_in_server() -> None:
    for package in ("buckets", "models"):
        for path in (ROOT / package).rglob("*.py"):
            assert not imported_roots(path) & {"starlette", "uvicorn", "prometheus_client"}, path
