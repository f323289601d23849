"""A follower rank (1..N-1) of a tensor-parallel server: join, load its shard, run rank 0's plans, exit.

Started by server.commands.tp_launch (`python -m server.commands.tp_worker`, settings in BUCKETSERVE_TP_SETTINGS, the mesh in
torchrun's variables) or, under torchrun, by the same `bucketserve serve ...` command as rank 0. It has no
HTTP port and no scheduler. Exit codes: 0 when rank 0 said stop; 1 when the mesh broke (rank 0 gone or
silent past the timeout, a bad layout); 2 when the settings are unreadable.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from models.loading import resolve_model_path
from models.mesh import MeshError, MeshSpec, backend_for, spec_from_env
from models.step_plan import PlanChannel, follow
from server.config import ServerSettings

log = logging.getLogger("bucketserve.mesh")


def follower_main(settings: ServerSettings, spec: MeshSpec) -> int:
    from server.engine.model import EngineModel

    # Rank 0 decides when the ranks stop (its drain, then a stop plan). A SIGINT or SIGTERM sent to the whole
    # process group (Ctrl-C, `kill -- -PGID`, torchrun forwarding) must not kill a follower under a draining
    # rank 0. A follower still always leaves: rank 0 gone -> its collectives fail; silent -> they time out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model = None
    try:
        path = resolve_model_path(settings.model, settings.model_cache_dir or None)
        model = EngineModel(settings, path, mesh_spec=spec)
        runner = model.build_runner()  # joins the mesh, loads this rank's shard
        assert model.mesh is not None and model.mesh.mesh is not None
        log.info("rank %d: loaded its shard; following rank 0", spec.rank)
        return follow(runner, PlanChannel(model.mesh.mesh), model.mesh.mesh)
    except MeshError as exc:
        log.error("rank %d exits: %s", spec.rank, exc)
        return 1
    finally:
        if model is not None:
            model.close()


def main() -> int:
    from server.commands.logs import configure_logging
    from server.commands.tp_launch import SETTINGS_ENV, settings_from_env

    text = os.environ.get(SETTINGS_ENV)
    if not text:
        print(f"tp_worker: {SETTINGS_ENV} is not set (this module is started by `bucketserve serve`)",
              file=sys.stderr)
        return 2
    settings = settings_from_env(text)
    configure_logging(settings.log_format)
    try:
        spec = spec_from_env(settings.tensor_parallel_size, settings.tp_timeout, None, backend_for(settings.device))
    except MeshError as exc:
        print(f"tp_worker: {exc}", file=sys.stderr)
        return 1
    if spec is None or spec.is_leader:
        print("tp_worker: RANK / WORLD_SIZE must name a follower rank (1..N-1)", file=sys.stderr)
        return 2
    return follower_main(settings, spec)


if __name__ == "__main__":
    sys.exit(main())
