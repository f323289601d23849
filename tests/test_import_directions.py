"""buckets/ is pure Python; models/ knows nothing of HTTP or buckets; only server/ touches Starlette,
uvicorn and prometheus-client. Inside server/: the HTTP layer (server/http) imports neither torch nor models
(except the torch-free models.params) nor the engine's implementation; the engine (server/engine) imports
neither Starlette nor pydantic nor the HTTP layer; metrics (server/metrics) need only prometheus-client."""

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
    "planner": {"server", "models", "torch", "starlette", "uvicorn", "pydantic"},
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
HTTP_MODULES = ("server.http.app", "server.http.protocol", "server.http.protocol_openai", "server.http.protocol_tgi",
                "server.http.errors", "server.http.limits", "server.http.admission", "server.http.output",
                "server.http.routes_openai", "server.http.routes_tgi", "server.http.state", "server.http.runs",
                "server.http.routes_misc", "server.http.routes_openapi", "server.http.detokenizer",
                "server.http.stop_strings", "server.http.format_openai", "server.http.format_tgi",
                "server.engine.interface", "server.metrics.hooks", "server.metrics.safe_hooks")
MODEL_STACK = ("torch", "transformers", "models.runner", "models.sampling", "server.engine.engine",
               "server.engine.model", "prometheus_client")


def test_http_layer_does_not_load_the_model_stack() -> None:
    """Importing the HTTP modules (a fresh interpreter) loads neither torch nor transformers nor the runner:
    pure records (models.params, server.engine.interface) are what crosses into it."""
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


# -- inside server/ ------------------------------------------------------------------------------------
# Per subpackage: third-party roots it must not import, and first-party modules it may import (prefixes;
# anything else of buckets/models/server/planner/bench is refused). TYPE_CHECKING imports count too.
STDLIB = sys.stdlib_module_names
SERVER_LAYERS: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "server/http": ({"torch", "transformers", "uvicorn", "prometheus_client", "numpy"},
                    ("buckets", "models.params", "server.config", "server.engine.interface", "server.http.",
                     "server.metrics.hooks", "server.metrics.safe_hooks")),
    "server/engine": ({"starlette", "pydantic", "uvicorn", "prometheus_client", "anyio", "httpx"},
                      ("buckets", "models", "server.config", "server.engine.", "server.metrics.hooks",
                       "server.metrics.safe_hooks")),
    "server/metrics": ({"torch", "transformers", "starlette", "pydantic", "uvicorn", "anyio", "httpx", "numpy",
                        "tokenizers"},
                       ("buckets", "server.metrics.")),
}
FIRST_PARTY = {"buckets", "models", "server", "planner", "bench", "tests"}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("layer", sorted(SERVER_LAYERS))
def test_server_layers(layer: str) -> None:
    forbidden, allowed = SERVER_LAYERS[layer]
    files = sorted((ROOT / layer).glob("*.py"))
    assert files
    for path in files:
        for module in sorted(imported_modules(path)):
            root = module.split(".")[0]
            where = f"{path.relative_to(ROOT)} imports {module}"
            assert root not in forbidden, where
            if root in FIRST_PARTY:
                assert any(module == a.rstrip(".") or module.startswith(a if a.endswith(".") else a + ".")
                           or module == a for a in allowed), where


def test_metrics_need_only_prometheus_client() -> None:
    """server/metrics: the standard library, buckets, prometheus-client and itself, nothing else."""
    for path in sorted((ROOT / "server/metrics").glob("*.py")):
        for module in imported_modules(path):
            root = module.split(".")[0]
            assert root in STDLIB or root in {"__future__", "prometheus_client", "buckets"} \
                or module.startswith("server.metrics"), f"{path.relative_to(ROOT)} imports {module}"


def test_every_http_module_is_checked() -> None:
    """HTTP_MODULES (the fresh-interpreter check) lists every module of server/http."""
    on_disk = {f"server.http.{p.stem}" for p in (ROOT / "server/http").glob("*.py") if p.stem != "__init__"}
    assert on_disk <= set(HTTP_MODULES), sorted(on_disk - set(HTTP_MODULES))
