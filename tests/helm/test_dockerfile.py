"""The Dockerfile, checked offline (no daemon here): it parses with Docker's own parser, its shell steps parse,
torch 2.13 goes in before the package, the final stage runs as the chart's non-root user with the compile cache
and models as volumes, and .dockerignore lets through exactly what `pip install .` needs."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import CHART_DIR, REPO

dockerfile = pytest.importorskip("dockerfile", reason="pip install dockerfile (Docker's Go parser)")

CACHE = "/var/cache/bucketserve/compile"


@pytest.fixture(scope="module")
def commands() -> list[Any]:
    return list(dockerfile.parse_file(str(REPO / "Dockerfile")))


def final_stage(commands: list[Any]) -> list[Any]:
    starts = [i for i, c in enumerate(commands) if c.cmd == "FROM"]
    return commands[starts[-1]:]


def test_base_image_is_python_311_slim(commands: list[Any]) -> None:
    assert commands[0].cmd == "ARG" and commands[0].value == ("BASE_IMAGE=python:3.11-slim",)
    assert all(c.value[0] == "${BASE_IMAGE}" for c in commands if c.cmd == "FROM")


def test_shell_steps_parse(commands: list[Any]) -> None:
    for command in commands:
        if command.cmd == "RUN" and not command.json:
            result = subprocess.run(["sh", "-n", "-c", command.value[0]], capture_output=True, text=True)
            assert result.returncode == 0, f"line {command.start_line}: {result.stderr}"


def test_torch_is_installed_before_the_package(commands: list[Any]) -> None:
    runs = [c.value[0] for c in commands if c.cmd == "RUN"]
    torch = next(i for i, r in enumerate(runs) if '"torch==2.13.*"' in r)
    package = next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert torch < package
    assert "--index-url" in runs[torch], "torch must come from a CPU or Neuron index, not PyPI's CUDA build"
    copies = [i for i, c in enumerate(commands) if c.cmd == "COPY" and c.value == (".", ".")]
    first_run_after_copy = [i for i, c in enumerate(commands) if c.cmd == "RUN" and "pip install ." in c.value[0]]
    assert copies and copies[0] < first_run_after_copy[0]
    torch_command = [i for i, c in enumerate(commands) if c.cmd == "RUN" and '"torch==2.13.*"' in c.value[0]]
    assert torch_command[0] < copies[0], "source changes must not invalidate the torch layer"


def test_final_stage_has_a_compiler(commands: list[Any]) -> None:
    """Inductor's CPU kernels and the native decode attention are compiled on the serving machine."""
    final = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    runs = [c.value[0] for c in commands[final:] if c.cmd == "RUN"]
    assert any("apt-get install" in run and "g++" in run for run in runs)


def test_final_stage_runs_as_the_charts_user(commands: list[Any]) -> None:
    stage = final_stage(commands)
    users = [c.value[0] for c in stage if c.cmd == "USER"]
    assert users, "the final stage must switch to a non-root user"
    uid, _, gid = users[-1].partition(":")
    assert uid not in ("0", "root") and gid not in ("0", "root")
    chart = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert int(uid) == chart["podSecurityContext"]["runAsUser"]
    assert int(gid) == chart["podSecurityContext"]["runAsGroup"]


def test_volumes_environment_and_entrypoint(commands: list[Any]) -> None:
    stage = final_stage(commands)
    volumes = [v for c in stage if c.cmd == "VOLUME" for v in c.value]
    assert set(volumes) == {CACHE, "/models"}
    env: dict[str, str] = {}
    for c in stage:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    assert env["BUCKETSERVE_COMPILE_CACHE_DIR"] == env["TORCH_NEURONX_NEFF_CACHE_DIR"] == CACHE
    chart = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert chart["compileCache"]["mountPath"] == CACHE
    assert chart["models"]["mountPath"] == "/models"
    (entrypoint,) = [c for c in stage if c.cmd == "ENTRYPOINT"]
    assert entrypoint.json and entrypoint.value == ("bucketserve", "serve", "--host", "0.0.0.0")
    assert [c.value for c in stage if c.cmd == "EXPOSE"] == [(str(chart["server"]["port"]),)]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the patterns used here: last match wins, `!` re-includes."""
    result = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/").removeprefix("**/")
        parts = path.split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))] + parts
        if any(fnmatch.fnmatch(c, body) for c in candidates):
            result = not negated
    return result


def test_dockerignore_keeps_only_what_the_build_needs() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = ["pyproject.toml", pyproject["project"]["readme"]]
    needed += [f"{package.replace('.', '/')}/__init__.py" for package in pyproject["tool"]["setuptools"]["packages"]]
    for path in needed:
        assert not ignored(path, patterns), f"{path} is needed by `pip install .`"
    for path in (".venv/bin/python", ".git/HEAD", "tests/helm/conftest.py", "helm/bucketserve/Chart.yaml",
                 "results/bench.json", "server/__pycache__/app.cpython-311.pyc", "Dockerfile"):
        assert ignored(path, patterns), f"{path} should stay out of the build context"


def build_context(destination: Path) -> list[str]:
    """Copy what Docker would send as the build context (the repository minus .dockerignore) to destination."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    reincluded = [p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")]
    copied: list[str] = []
    for root, dirs, files in os.walk(REPO):
        relative_root = os.path.relpath(root, REPO)
        prefix = "" if relative_root == "." else relative_root + "/"
        # prune ignored directories that no `!` pattern reaches into (.venv, .git, tests, ...)
        dirs[:] = [d for d in dirs if not ignored(prefix + d, patterns)
                   or any(r.startswith(prefix + d + "/") for r in reincluded)]
        for name in files:
            path = prefix + name
            if not ignored(path, patterns):
                target = destination / path
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / path, target)
                copied.append(path)
    return copied


def test_the_build_context_builds_the_package(tmp_path: Path) -> None:
    """`pip install .` inside the image sees only the context: a wheel built from it must hold every package
    and the `bucketserve` command (offline: no build isolation, no dependencies)."""
    pytest.importorskip("setuptools")
    context = tmp_path / "context"
    copied = build_context(context)
    assert "pyproject.toml" in copied and not any(p.startswith(("tests/", "helm/", ".venv/")) for p in copied)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("bucketserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"].get("package-data", {})
    for package in pyproject["tool"]["setuptools"]["packages"]:
        folder = package.replace(".", "/") + "/"
        # its modules and its declared data files (e.g. the native kernels' C sources in models.csrc)
        sources = {p for p in copied if p.startswith(folder) and p.count("/") == folder.count("/")
                   and (p.endswith(".py") or any(fnmatch.fnmatch(p[len(folder):], pattern) for pattern in data.get(package, [])))}
        assert sources and sources <= set(names), f"{package}: {sorted(sources - set(names))} missing"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "bucketserve = server.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
