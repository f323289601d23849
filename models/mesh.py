"""The process mesh of a tensor-parallel server: its layout, the join of every rank, and the process group.

Every rank calls `join_mesh` with the same `MeshSpec`. The layout is checked before anything connects (the
product of the parallel dimensions must be the world size); then every rank announces itself in a
TCPStore and rank 0 waits, up to the timeout, for all of them, naming the ranks that never came; only then
is the gloo process group created (transformers finds it initialised and builds its device mesh on it).
Every collective of the group has a timeout, so a rank that stops answering fails the others instead of
hanging them.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.distributed as dist

log = logging.getLogger(__name__)

# Compiling one graph can take minutes, and not equally long on every rank: until warm-up is over the
# collectives wait this long for a slower rank; serving then uses the spec's (short) timeout.
WARMUP_TIMEOUT = 1800.0
_JOIN_KEY = "bucketserve/joined/"
# The process group per device: the step plans are CPU objects and always go over gloo; the model's own
# collectives use the device's backend. Only "cpu" has run here; the others are transformers' device map
# (neuron on Trainium, nccl on CUDA) and are untested.
BACKENDS = {"cpu": "gloo", "neuron": "cpu:gloo,neuron:neuron", "cuda": "cpu:gloo,cuda:nccl"}


def backend_for(device: str) -> str:
    try:
        return BACKENDS[device]
    except KeyError:
        raise MeshError(f"no tensor-parallel process group backend for device {device!r} "
                        f"(known: {sorted(BACKENDS)})") from None


class MeshError(RuntimeError):
    """The mesh is wrong or broken: a bad layout, a rank missing or gone, ranks out of step. Fatal."""


@dataclass(frozen=True)
class MeshSpec:
    """One rank's view of the mesh. Only tensor parallelism is served: the other dimensions are 1."""

    tp_size: int
    world_size: int
    rank: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    timeout: float = 60.0  # seconds: joining, and any collective while serving
    uses_agent_store: bool = False  # torchrun's agent already serves the store at master_addr:port
    backend: str = "gloo"
    # Rank 0's store when it was served before the followers started (serve_store): they connect at once
    # instead of racing rank 0's start-up against the timeout.
    store: Any = field(default=None, compare=False, repr=False)
    dims: tuple[tuple[str, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", (("tp", self.tp_size), ("pp", 1), ("dp", 1)))
        if self.tp_size < 1:
            raise MeshError(f"tensor_parallel_size must be >= 1, got {self.tp_size}")
        product = math.prod(n for _, n in self.dims)
        if product != self.world_size:
            layout = " x ".join(f"{name}={n}" for name, n in self.dims)
            raise MeshError(f"the parallel dimensions {layout} need {product} processes, but the world size is "
                            f"{self.world_size}: launch {product} ranks or set --tensor-parallel-size "
                            f"{self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise MeshError(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if not self.timeout > 0:
            raise MeshError(f"tp_timeout must be positive, got {self.timeout}")
        if not 0 < self.master_port < 65536:
            raise MeshError(f"MASTER_PORT must be in 1..65535, got {self.master_port}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.tp_size, "world_size": self.world_size, "backend": self.backend,
                "dims": dict(self.dims)}

    def env(self, rank: int) -> dict[str, str]:
        """The torchrun-style variables rank `rank` of this mesh is started with."""
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def spec_from_env(tp_size: int, timeout: float, environ: Mapping[str, str] | None = None,
                  backend: str = "gloo") -> MeshSpec | None:
    """The spec torchrun's variables describe (None when they are not set)."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        return MeshSpec(tp_size=tp_size, world_size=int(env["WORLD_SIZE"]), rank=int(env["RANK"]),
                        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                        master_port=int(env.get("MASTER_PORT", "29500")), timeout=timeout,
                        uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                        backend=backend)
    except ValueError as exc:
        if isinstance(exc, MeshError):
            raise
        raise MeshError(f"bad torchrun variables RANK/WORLD_SIZE/MASTER_PORT: {exc}") from exc


@dataclass
class Mesh:
    """A joined mesh: the spec, the store every rank shares, and the gloo process group (the default one)."""

    spec: MeshSpec
    store: Any  # torch.distributed.Store
    joined_seconds: float

    def set_timeout(self, seconds: float) -> None:
        """Timeout of every later collective of the group (warm-up allows more than serving)."""
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_store(spec: MeshSpec) -> Any:
    """Rank 0: serve the mesh's TCPStore now (before starting the followers)."""
    try:
        return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, True,
                             timeout=datetime.timedelta(seconds=spec.timeout), wait_for_workers=False)
    except (RuntimeError, TimeoutError) as exc:
        raise MeshError(f"rank 0 could not serve the mesh store at {spec.master_addr}:{spec.master_port}: "
                        f"{exc}") from exc


def join_mesh(spec: MeshSpec, *, poll: float = 0.05) -> Mesh:
    """Connect this rank; rank 0 returns once every rank has joined, or raises MeshError naming the missing
    ranks after spec.timeout seconds. The group starts with the warm-up timeout (see WARMUP_TIMEOUT)."""
    if dist.is_initialized():
        raise MeshError("a process group is already initialised in this process: the mesh is joined once")
    start = time.monotonic()
    timeout = datetime.timedelta(seconds=spec.timeout)
    is_server = spec.is_leader and not spec.uses_agent_store
    where = f"{spec.master_addr}:{spec.master_port}"
    try:
        store = spec.store if spec.store is not None else dist.TCPStore(
            spec.master_addr, spec.master_port, spec.world_size, is_server, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        who = "could not serve the mesh store" if is_server else "could not reach rank 0's store"
        raise MeshError(f"rank {spec.rank} {who} at {where} within {spec.timeout:g} s: {exc}") from exc
    store.set(f"{_JOIN_KEY}{spec.rank}", str(os.getpid()))
    if spec.is_leader:
        keys = [f"{_JOIN_KEY}{r}" for r in range(spec.world_size)]
        deadline = start + spec.timeout
        while True:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            if not missing:
                break
            if time.monotonic() >= deadline:
                joined = [r for r in range(spec.world_size) if r not in missing]
                raise MeshError(f"ranks {missing} of {spec.world_size} did not join the mesh at {where} within "
                                f"{spec.timeout:g} s (joined: {joined})")
            time.sleep(poll)
    try:
        dist.init_process_group(spec.backend, store=dist.PrefixStore("bucketserve/pg", store), rank=spec.rank,
                                world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=max(spec.timeout, WARMUP_TIMEOUT)))
    except (RuntimeError, TimeoutError) as exc:
        raise MeshError(f"rank {spec.rank} could not create the {spec.backend} process group: {exc}") from exc
    seconds = time.monotonic() - start
    log.info("rank %d of %d joined the mesh (%s, tp=%d) in %.2f s", spec.rank, spec.world_size, spec.backend,
             spec.tp_size, seconds)
    return Mesh(spec, store, seconds)
