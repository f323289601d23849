"""`bucketserve precompile`: warm every graph into the persistent compile cache, print a manifest, exit."""

from __future__ import annotations

import json
import logging

from models.loading import resolve_model_path
from models.mesh import MeshSpec
from server.config import ServerSettings
from server.engine_model import EngineModel

log = logging.getLogger("bucketserve.precompile")


def precompile_main(settings: ServerSettings) -> int:
    from server.tp_launch import run_ranked  # tensor parallel: every rank warms its graphs

    return run_ranked(settings, lambda spec, launch: _precompile(settings, spec))


def _precompile(settings: ServerSettings, mesh_spec: MeshSpec | None) -> int:
    path = resolve_model_path(settings.model, settings.model_cache_dir or None)
    model = EngineModel(settings, path, mesh_spec=mesh_spec)
    model.load_and_warm()
    manifest = {
        "model": model.name,
        "dtype": model.dtype,
        "threads": model.num_threads,
        "device": settings.device,
        "compile_backend": settings.compile_backend,
        "compile_cache_dir": model.compile_cache_dir(),
        "buckets": model.table.to_dict(),
        "graphs": [
            {"graph": r.key.phase, "bucket": r.key.bucket, "seconds": round(r.seconds, 3)}
            for r in model.accountant.records
        ],
        "warmup_seconds": round(model.progress.seconds, 3),
        "mesh": model.mesh_info(),
    }
    print(json.dumps(manifest, indent=2))
    model.close()
    return 0
