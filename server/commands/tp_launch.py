"""Starting the ranks of a tensor-parallel server, and stopping them.

`run_ranked(settings, lead)` is the one entry for serve, generate and precompile:
- under torchrun (RANK / WORLD_SIZE set) every process is already a rank: rank 0 runs `lead`, the others
  follow (server.commands.tp_worker);
- with --tensor-parallel-size N > 1 and no torchrun, this process becomes rank 0 and starts ranks 1..N-1
  itself (`python -m server.commands.tp_worker`, torchrun's variables, the settings as JSON in the environment),
  and stops them when `lead` returns, whatever happened;
- otherwise `lead` runs alone with no mesh.
Before starting anything, the layout (product of the parallel dimensions == world size) and the model's
divisibility by the TP size are checked, so a bad layout fails in a second, not after N loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

from models.loading import resolve_model_path
from models.mesh import MeshError, MeshSpec, backend_for, serve_store, spec_from_env
from server.config import ServerSettings

log = logging.getLogger("bucketserve.mesh")

SETTINGS_ENV = "BUCKETSERVE_TP_SETTINGS"  # the followers' settings, as JSON (not argv: API keys stay out of ps)


@dataclass
class RankLaunch:
    """This process's place in the mesh, and the follower processes it started (it stops them)."""

    spec: MeshSpec | None
    followers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def dead_follower(self) -> str | None:
        """A message naming the first started follower that has exited, else None."""
        for rank, proc in self.followers.items():
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"rank {rank} of the tensor-parallel mesh {how}"
        return None

    def stop(self, grace: float = 10.0) -> None:
        """Followers leave on rank 0's stop plan; whatever is still running after `grace` s is killed."""
        for proc in self.followers.values():
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
        for rank, proc in self.followers.items():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
            log.info("rank %d exited with code %s", rank, proc.returncode)


def settings_to_env(settings: ServerSettings) -> str:
    return json.dumps(dataclasses.asdict(settings))


def settings_from_env(text: str) -> ServerSettings:
    values = json.loads(text)
    for f in dataclasses.fields(ServerSettings):
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return ServerSettings(**values)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_model_fits(settings: ServerSettings) -> None:
    """The model can be split N ways (heads, sharded dimensions, a whole checkpoint): fails before any launch."""
    from transformers import AutoConfig

    from models.sharding import check_checkpoint_whole, check_shardable, shard_layout

    path = resolve_model_path(settings.model, settings.model_cache_dir or None)
    config = AutoConfig.from_pretrained(path)
    layout = shard_layout(config)
    check_shardable(config, layout, settings.tensor_parallel_size)
    check_checkpoint_whole(path, layout)


def start_ranks(settings: ServerSettings, environ: Mapping[str, str] | None = None) -> RankLaunch:
    env = dict(os.environ if environ is None else environ)
    tp = settings.tensor_parallel_size
    backend = backend_for(settings.device)
    spec = spec_from_env(tp, settings.tp_timeout, env, backend)
    if spec is not None and spec.world_size > 1:
        return RankLaunch(spec)  # torchrun (or we, for a follower) started this rank
    if tp == 1:
        return RankLaunch(None)
    spec = MeshSpec(tp_size=tp, world_size=tp, rank=0, master_addr="127.0.0.1", master_port=_free_port(),
                    timeout=settings.tp_timeout, backend=backend)
    check_model_fits(settings)
    spec = dataclasses.replace(spec, store=serve_store(spec))  # up before the followers look for it
    launch = RankLaunch(spec)
    child_env = {**env, SETTINGS_ENV: settings_to_env(settings)}
    for rank in range(1, tp):
        launch.followers[rank] = subprocess.Popen([sys.executable, "-m", "server.commands.tp_worker"],
                                                  env={**child_env, **spec.env(rank)}, stdin=subprocess.DEVNULL)
    log.info("started ranks 1..%d of the tensor-parallel mesh (pids %s); rendezvous at %s:%d", tp - 1,
             [p.pid for p in launch.followers.values()], spec.master_addr, spec.master_port)
    return launch


def run_ranked(settings: ServerSettings, lead: Callable[[MeshSpec | None, RankLaunch], int]) -> int:
    """Run `lead` on rank 0 (or alone), follow on the other ranks; stop the followers this process started."""
    try:
        launch = start_ranks(settings)
    except MeshError as exc:
        print(f"bucketserve: error: {exc}", file=sys.stderr)
        return 1
    if launch.spec is not None and not launch.spec.is_leader:
        from server.commands.tp_worker import follower_main

        return follower_main(settings, launch.spec)
    try:
        return lead(launch.spec, launch)
    finally:
        launch.stop()
