"""Rank 0 leads, the other ranks follow: each runner call's plan is broadcast before rank 0 runs it.

Every rank holds the same runner (same bucket table, same compiled graphs, its own shard of the weights and
its local KV heads). The graphs' collectives (all-reduce after row-wise layers, the gather of the logits)
need every rank to run the same graph at the same time, so rank 0's `LeaderRunner` broadcasts what it is
about to run (phase, bucket, input ids, positions, slots) over the gloo group first, and `follow` runs the
same call on the other ranks. Sampling runs on rank 0 alone: the logits come back whole on every rank.

Failures: a call that fails the same way on every rank before any collective (an unknown or unwarmed shape,
a prompt that does not fit) is raised on rank 0 and logged on the followers, and serving goes on; anything
else inside a step (a peer gone: gloo's connection error; a peer hung: the group's timeout) leaves the ranks
out of step and is raised as MeshError, which stops the server. When idle, rank 0 sends a heartbeat that
every rank answers with its compile counts, so a dead or hung follower is found without traffic.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

from models.compile import CompileAccountant, RecompileError
from models.mesh import Mesh, MeshError
from models.runner import ModelRunner, PrefillRow, UnknownShapeError

T = TypeVar("T")

log = logging.getLogger(__name__)

# Failures every rank meets identically before any collective runs: the ranks stay in step.
SYMMETRIC_ERRORS = (UnknownShapeError, RecompileError, ValueError)


@dataclass(frozen=True)
class WarmupPlan:
    keys: tuple[tuple[str, int, int], ...]  # (phase, batch, length) in rank 0's order


@dataclass(frozen=True)
class PrefillPlan:
    rows: tuple[tuple[int, tuple[int, ...]], ...]  # (slot, prompt ids)
    length: int
    batch: int


@dataclass(frozen=True)
class DecodePlan:
    batch: int
    kv: int | None
    tokens: tuple[int, ...]  # [batch]: row i = slot i
    positions: tuple[int, ...]  # [batch]


@dataclass(frozen=True)
class ChunkPlan:
    slot: int
    offset: int
    token_ids: tuple[int, ...]
    kv: int


@dataclass(frozen=True)
class HeartbeatPlan:
    """Answered by every rank with its compile counts (an all-gather: a hung rank times it out)."""


@dataclass(frozen=True)
class StopPlan:
    """Rank 0 is shutting down: followers leave their loop and exit 0."""


Plan = WarmupPlan | PrefillPlan | DecodePlan | ChunkPlan | HeartbeatPlan | StopPlan


@dataclass(frozen=True)
class RankCompiles:
    rank: int
    warmup: int
    serving: int  # compilations after warm-up: must stay 0
    refused: int  # compilations refused after warm-up (policy "error")


class PlanChannel:
    """Plans from rank 0 to the others over the default (gloo) group; every call is a collective."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.rank = mesh.spec.rank

    def send(self, plan: Plan) -> None:
        self._broadcast(plan)

    def receive(self) -> Plan:
        plan = self._broadcast(None)
        assert plan is not None
        return plan

    def _broadcast(self, plan: Plan | None) -> Plan | None:
        box: list[Any] = [plan]
        try:
            dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))  # over gloo on any device
        except RuntimeError as exc:  # gloo: peer closed the connection, or the group's timeout
            raise MeshError(f"rank {self.rank}: the step plan broadcast failed: {exc}") from exc
        return box[0]  # type: ignore[no-any-return]

    def gather_compiles(self, accountant: CompileAccountant, refused: int) -> list[RankCompiles]:
        mine = RankCompiles(self.rank, accountant.count("warmup"), accountant.count("serving"), refused)
        out: list[Any] = [None] * self.mesh.spec.world_size
        try:
            dist.all_gather_object(out, mine)
        except RuntimeError as exc:
            raise MeshError(f"rank {self.rank}: gathering compile counts failed: {exc}") from exc
        return out


class LeaderRunner(ModelRunner):
    """Rank 0's runner: broadcasts each call's plan, then runs it like a single-process runner."""

    def __init__(self, model: torch.nn.Module, table: Any, compile_settings: Any, accountant: CompileAccountant,
                 mesh: Mesh, heartbeat_interval: float | None = None) -> None:
        super().__init__(model, table, compile_settings, accountant, tp_size=mesh.spec.tp_size)
        self.mesh = mesh
        self.channel = PlanChannel(mesh)
        self.refused = 0
        self.rank_compiles: list[RankCompiles] = []
        self.heartbeat_interval = heartbeat_interval or min(2.0, mesh.spec.timeout / 4)
        self._last_exchange = time.monotonic()
        self._stopped = False

    def warmup(self, keys: Iterable[Any] | None = None,
               progress: Callable[[Any, float, int, int], None] | None = None, builder: Any = None,
               cancelled: Callable[[], bool] | None = None) -> float:
        # No builder processes under a mesh: a rank's graphs run collectives with the other ranks.
        todo = list(self.keys if keys is None else keys)
        self._lead(WarmupPlan(tuple((k.phase, k.batch, k.length) for k in todo)))
        seconds = self._guard(lambda: super(LeaderRunner, self).warmup(todo, progress, None, cancelled))
        self.rank_compiles = self.channel.gather_compiles(self.accountant, self.refused)
        self.mesh.set_timeout(self.mesh.spec.timeout)  # from now on a slow rank is a broken one
        return seconds

    def prefill(self, rows: list[PrefillRow], length: int, batch: int) -> torch.Tensor:
        self._lead(PrefillPlan(tuple((r.slot, tuple(r.token_ids)) for r in rows), length, batch))
        return self._guard(lambda: super(LeaderRunner, self).prefill(rows, length, batch))

    def decode(self, batch: int, tokens: torch.Tensor, positions: torch.Tensor, kv: int | None = None) -> torch.Tensor:
        self._lead(DecodePlan(batch, kv, tuple(tokens.tolist()), tuple(positions.tolist())))
        return self._guard(lambda: super(LeaderRunner, self).decode(batch, tokens, positions, kv))

    def chunk(self, slot: int, offset: int, token_ids: list[int], kv: int) -> torch.Tensor:
        self._lead(ChunkPlan(slot, offset, tuple(token_ids), kv))
        return self._guard(lambda: super(LeaderRunner, self).chunk(slot, offset, token_ids, kv))

    def heartbeat(self, force: bool = False) -> list[RankCompiles] | None:
        """When idle for heartbeat_interval (or forced): every rank answers with its compile counts."""
        if not force and time.monotonic() - self._last_exchange < self.heartbeat_interval:
            return None
        self._lead(HeartbeatPlan())
        self.rank_compiles = self.channel.gather_compiles(self.accountant, self.refused)
        return self.rank_compiles

    def stop_followers(self) -> None:
        """Tell the followers to exit (best effort: they may be gone already)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.channel.send(StopPlan())
        except MeshError as exc:
            log.warning("could not tell the followers to stop: %s", exc)

    def _lead(self, plan: Plan) -> None:
        if self._stopped:
            raise MeshError("the followers have been stopped")
        self.channel.send(plan)
        self._last_exchange = time.monotonic()

    def _guard(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except SYMMETRIC_ERRORS:
            raise
        except MeshError:
            raise
        except Exception as exc:  # noqa: BLE001 - inside a step the ranks may now be out of step
            raise MeshError(f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc}); "
                            "the ranks are out of step") from exc
        finally:
            self._last_exchange = time.monotonic()


def rank_runner(model: torch.nn.Module, table: Any, compile_settings: Any, accountant: CompileAccountant,
                mesh: Mesh | None) -> ModelRunner:
    """The runner for this process: plain without a mesh, leading on rank 0, plain (driven by `follow`)
    on the other ranks; under a mesh the slot cache holds the local KV heads."""
    if mesh is None:
        return ModelRunner(model, table, compile_settings, accountant)
    if mesh.spec.is_leader:
        return LeaderRunner(model, table, compile_settings, accountant, mesh)
    return ModelRunner(model, table, compile_settings, accountant, tp_size=mesh.spec.tp_size)


def follow(runner: ModelRunner, channel: PlanChannel, mesh: Mesh) -> int:
    """A follower's whole life after loading: run every plan rank 0 sends until it says stop. Returns 0;
    raises MeshError when rank 0 is gone or silent for longer than the group's timeout."""
    by_key = {(k.phase, k.batch, k.length): k for k in runner.keys}
    refused = 0

    def on_refused(key: Any, reason: str) -> None:
        nonlocal refused
        refused += 1

    runner.accountant.on_refused = on_refused
    while True:
        plan = channel.receive()
        try:
            if isinstance(plan, StopPlan):
                log.info("rank %d: rank 0 is stopping; leaving", channel.rank)
                return 0
            if isinstance(plan, WarmupPlan):
                # Sampling graphs run on rank 0 only: they have no collectives and their output is not needed.
                runner.warmup([by_key[k] for k in plan.keys if k[0] != "sample"])
                channel.gather_compiles(runner.accountant, refused)
                mesh.set_timeout(mesh.spec.timeout)
            elif isinstance(plan, HeartbeatPlan):
                channel.gather_compiles(runner.accountant, refused)
            else:
                _run(runner, plan)
        except SYMMETRIC_ERRORS as exc:
            log.warning("rank %d: %s failed as on rank 0: %s", channel.rank, type(plan).__name__, exc)


def _run(runner: ModelRunner, plan: Plan) -> None:
    if isinstance(plan, PrefillPlan):
        runner.prefill([PrefillRow(slot, list(ids)) for slot, ids in plan.rows], plan.length, plan.batch)
    elif isinstance(plan, DecodePlan):
        tokens = torch.tensor(plan.tokens, dtype=torch.long)
        positions = torch.tensor(plan.positions, dtype=torch.long)
        runner.decode(plan.batch, tokens, positions, plan.kv)
    elif isinstance(plan, ChunkPlan):
        runner.chunk(plan.slot, plan.offset, list(plan.token_ids), plan.kv)
    else:
        raise MeshError(f"unknown step plan {plan!r}")
