"""Compiled graphs as files: one artifact per bucket, saved after its first compile, loaded on restart.

An artifact is a dynamo ahead-of-time compiled function (`torch.compile(...).aot_compile`, saved with
`save_compiled_function`): the traced bytecode, its guards and inductor's compiled code, without weights (the
model is an argument of every step function, so its parameters are graph inputs, not constants). Loading
one skips tracing, guard building and code generation: about 0.2 s per graph of the default model against
about 4 s to re-trace a graph whose kernels the inductor cache still holds. It is the CPU counterpart of a
Neuron NEFF.

Each artifact `<label>.bin` has a sidecar `<label>.json` (sha256, size, torch version, build seconds). A file
that is missing, truncated, altered, from another torch version or that does not deserialize is reported
with a reason and rebuilt by the caller, never used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)



def guard_filter(entries: list[Any]) -> list[bool]:
    """Which of dynamo's guards an artifact keeps. Only guards a new process can re-check can be saved:
    global state (grad mode, thread count...) and tensor metadata. Object-identity guards on the model are
    dropped (the runner dispatches by bucket itself and hands every graph the same model and its bucket's
    cache objects), and so are the ~300 per-parameter tensor guards: rebuilding them costs 0.3 s per graph
    at load, and the parameters' names, shapes, dtypes and strides are checked once per model instead
    (`model_fingerprint`, kept in the sidecar)."""
    return [
        g.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
        or (g.guard_type == "TENSOR_MATCH" and not g.is_global and not isinstance(g.value, torch.nn.Parameter))
        for g in entries
    ]


def model_fingerprint(model: torch.nn.Module) -> str:
    """What the compiled code assumes about the weights: every parameter's and buffer's name, shape, dtype,
    stride and device (not the values: those are graph inputs)."""
    items = [(name, tuple(t.shape), str(t.dtype), t.stride(), str(t.device))
             for name, t in [*model.named_parameters(), *model.named_buffers()]]
    return hashlib.sha256(repr(items).encode()).hexdigest()


@dataclass(frozen=True)
class Loaded:
    fn: Callable[..., Any] | None  # None: not usable (see reason)
    reason: str = ""  # "" loaded | "missing" | "corrupt: ..." | "stale: ..."
    seconds: float = 0.0


def label_of(key: Any) -> str:
    """A file name for a graph key: `decode-b8_kv512`."""
    return f"{key.phase}-{key.bucket}"


@dataclass(frozen=True)
class GraphStore:
    """A directory of compiled graph artifacts, one pair of files per graph key. The directory itself is
    keyed (model, weights, dtype, device, buckets, backend, threads, versions) by whoever chooses it."""

    root: str

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("a graph store needs a directory")

    def _paths(self, key: Any) -> tuple[Path, Path]:
        base = Path(self.root) / label_of(key)
        return base.with_suffix(".bin"), base.with_suffix(".json")

    def has(self, key: Any) -> bool:
        """Both files are there (validity is checked on load)."""
        blob, meta = self._paths(key)
        return blob.is_file() and meta.is_file()

    def save(self, key: Any, fn: Any, build_seconds: float, model: str) -> None:
        """Write the artifact, then its sidecar: a reader never sees a sidecar for a half-written file."""
        blob, meta = self._paths(key)
        blob.parent.mkdir(parents=True, exist_ok=True)
        data = type(fn).serialize(fn).serialized_data
        _atomic_write(blob, data)
        info = {"graph": str(key), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "torch": torch.__version__, "model": model, "build_seconds": round(build_seconds, 3), "created": time.time()}
        _atomic_write(meta, json.dumps(info, indent=1).encode())

    def load(self, key: Any, model: str) -> Loaded:
        """`model`: the fingerprint of the weights the artifact will run with."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        blob, meta = self._paths(key)
        if not blob.is_file() or not meta.is_file():
            return Loaded(None, "missing")
        start = time.perf_counter()
        try:
            info = json.loads(meta.read_text())
            data = blob.read_bytes()
        except (OSError, ValueError) as exc:
            return Loaded(None, f"corrupt: unreadable ({exc})")
        if not isinstance(info, dict) or len(data) != info.get("bytes"):
            said = info.get("bytes") if isinstance(info, dict) else "?"
            return Loaded(None, f"corrupt: {len(data)} bytes, the sidecar says {said}")
        if hashlib.sha256(data).hexdigest() != info.get("sha256"):
            return Loaded(None, "corrupt: checksum mismatch")
        if info.get("torch") != torch.__version__:
            return Loaded(None, f"stale: built by torch {info.get('torch')}, running {torch.__version__}")
        if info.get("model") != model:
            return Loaded(None, "stale: built for weights of other names, shapes or dtypes")
        try:
            fn = AOTCompiledFunction.deserialize(data)
        except Exception as exc:  # noqa: BLE001  any failure to rebuild the function means: do not use it
            return Loaded(None, f"stale: does not load ({type(exc).__name__}: {str(exc)[:200]})")
        return Loaded(fn, "", time.perf_counter() - start)

    def info(self, key: Any) -> dict[str, Any]:
        """The sidecar of a saved artifact ({} when there is none or it is unreadable)."""
        try:
            info = json.loads(self._paths(key)[1].read_text())
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def remove(self, key: Any) -> None:
        for path in self._paths(key):
            path.unlink(missing_ok=True)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@functools.cache
def aot_available() -> bool:
    """Whether this torch compiles ahead of time (`torch.compile(...).aot_compile`, torch 2.13 here; the images
    of some accelerator hosts ship older torch builds). Without it graphs compile in-process, unsaved."""
    return hasattr(torch.compile(lambda: None, backend="eager"), "aot_compile")


def aot_compile(fn: Callable[..., Any], backend: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Compile `fn(*args)` ahead of time into a serializable function (static shapes, one graph, no break).
    The result checks its guards on every call until `disable_guard_check()`."""
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False,
                             options={"guard_filter_fn": guard_filter})
    return compiled.aot_compile((args, {}))  # type: ignore[attr-defined]
