"""`bucketserve precompile`: warm every graph into the persistent compile cache, print a manifest, exit.

The manifest lists each graph with what this run spent on it (`seconds`: a compile, or loading its saved
artifact), whether it came from the cache, and what its artifact cost to compile cold (`cold_seconds`), so
one run on a filled cache shows both the cold and the warm price of every bucket.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from models.artifacts import GraphStore
from models.compile import CompileRecord
from models.mesh import MeshSpec
from server.compose import build_model
from server.config import ServerSettings
from server.engine.model import EngineModel

log = logging.getLogger("bucketserve.precompile")


def precompile_main(settings: ServerSettings) -> int:
    from server.commands.tp_launch import run_ranked  # tensor parallel: every rank warms its graphs

    return run_ranked(settings, lambda spec, launch: _precompile(settings, spec))


def _precompile(settings: ServerSettings, mesh_spec: MeshSpec | None) -> int:
    model = build_model(settings, mesh_spec=mesh_spec)
    model.load_and_warm()
    manifest = {
        "model": model.name,
        "dtype": model.dtype,
        "threads": model.num_threads,
        "device": settings.device,
        "compile_backend": settings.compile_backend,
        "compile_cache_dir": model.compile_cache_dir(),
        "buckets": model.table.to_dict(),
        "graphs": [_graph_entry(model, r) for r in model.accountant.records],
        "warmup_seconds": round(model.progress.seconds, 3),
        "mesh": model.mesh_info(),
        "process_seconds": _process_age(),
    }
    print(json.dumps(manifest, indent=2))
    model.close()
    return 0


def _graph_entry(model: EngineModel, record: CompileRecord) -> dict[str, Any]:
    key = record.key
    entry: dict[str, Any] = {"graph": key.phase, "bucket": key.bucket, "seconds": round(record.seconds, 3),
                             "from_cache": record.cache_hit}
    store: GraphStore | None = model.runner.graphs.store if model.runner is not None else None
    if store is not None:
        info = store.info(key)
        entry["cold_seconds"] = info.get("build_seconds")
        entry["artifact_bytes"] = info.get("bytes")
    return entry


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), imports included; None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 3)
