"""The tensor-parallel side of an EngineModel: join the mesh, load this rank's shard, and keep what /ready,
the metrics and the logs say about the ranks (each one's compilations, gathered by rank 0's heartbeat)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from models.mesh import Mesh, MeshSpec, join_mesh
from models.runner import ModelRunner
from models.sharding import load_sharded
from models.step_plan import LeaderRunner, RankCompiles

log = logging.getLogger("bucketserve.mesh")


class EngineMesh:
    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.mesh: Mesh | None = None  # joined by load()
        self.rank_compiles: list[RankCompiles] = []

    @property
    def note(self) -> str:
        return f", rank {self.spec.rank} of tensor-parallel mesh tp={self.spec.tp_size}"

    def load(self, path: str, dtype: str) -> torch.nn.Module:
        """Join the mesh (rank 0: every rank within the timeout), then load this rank's shard, checked."""
        self.mesh = join_mesh(self.spec)
        return load_sharded(path, dtype, self.spec.tp_size)

    def warmed(self, runner: ModelRunner | None, metrics: Any) -> None:
        """Rank 0 after warm-up: every rank's compile counts (gathered at the end of the warm-up)."""
        if isinstance(runner, LeaderRunner):
            self._update(runner.rank_compiles, metrics)
            log.info("mesh %s: compilations per rank: %s", self.spec.describe(),
                     ", ".join(f"rank {c.rank}: {c.warmup} at warm-up, {c.serving} after" for c in self.rank_compiles))

    def tick(self, runner: ModelRunner | None, metrics: Any) -> None:
        """Rank 0, between steps: heartbeat the followers when idle (MeshError when one is gone or hung)."""
        if isinstance(runner, LeaderRunner):
            counts = runner.heartbeat()
            if counts is not None:
                self._update(counts, metrics)

    def info(self) -> dict[str, Any]:
        info = self.spec.describe()
        info["ranks"] = [{"rank": c.rank, "compilations_warmup": c.warmup, "compilations_serving": c.serving,
                          "refused": c.refused} for c in self.rank_compiles]
        return info

    def close(self, runner: ModelRunner | None) -> None:
        if isinstance(runner, LeaderRunner):
            runner.stop_followers()
        if self.mesh is not None:
            self.mesh.close()
            self.mesh = None

    def _update(self, counts: list[RankCompiles], metrics: Any) -> None:
        before = {c.rank: c.serving for c in self.rank_compiles}
        self.rank_compiles = list(counts)
        for c in counts:
            metrics.rank_compilations(c.rank, c.warmup, c.serving)
            if c.rank != 0:  # a follower's compile after warm-up is a recompile too (rank 0's count as they happen)
                for _ in range(c.serving - before.get(c.rank, 0)):
                    metrics.recompiled("other_rank")
