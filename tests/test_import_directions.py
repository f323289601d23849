"""buckets/ is pure Python; models/ knows nothing of HTTP or buckets; only server/ touches Starlette,
uvicorn and prometheus-client; server/'s HTTP layer does not load torch, transformers or the runner."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
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


# The HTTP layer of server/: it builds and validates records, never runs the model.
HTTP_MODULES = ("server.app", "server.protocol", "server.protocol_openai", "server.protocol_tgi", "server.errors",
                "server.limits", "server.admission", "server.output", "server.routes_openai", "server.routes_tgi",
                "server.routes_common", "server.routes_runs", "server.routes_misc", "server.detokenizer",
                "server.stop_strings", "server.engine_types")
MODEL_STACK = ("torch", "transformers", "models.runner", "models.sampling", "server.engine", "server.engine_model")


def test_http_layer_does_not_load_the_model_stack() -> None:
    """Importing the HTTP modules (a fresh interpreter) loads neither torch nor transformers nor the runner:
    pure records (models.params, server.engine_types) are what crosses into it."""
    code = (f"import sys\nimport {', '.join(HTTP_MODULES)}\n"
            f"print(','.join(m for m in {MODEL_STACK!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the HTTP layer loads {out.stdout.strip()}"


@pytest.mark.parametrize("module", HTTP_MODULES)
def test_http_modules_import_no_model_code(module: str) -> None:
    path = ROOT / (module.replace(".", "/") + ".py")
    bad = imported_roots(path) & {"torch", "transformers"}
    assert not bad, f"{module} imports {sorted(bad)}"
    models = {n.module for n in ast.walk(ast.parse(path.read_text()))
              if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "models"}
    assert models <= {"models.params"}, f"{module} imports {sorted(models)} (only the torch-free models.params)"
