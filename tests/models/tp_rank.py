"""One rank of a 2-process tensor-parallel run of tp_workload (started by test_tensor_parallel.py).

argv: checkpoint dir, compile backend, output file. The mesh comes from torchrun-style variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 writes the workload's tokens and logits, every rank's compile
counts, and what check_sharding says about three tampered copies of a parameter.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp_workload import TABLE, run_workload  # noqa: E402

from models.compile import CompileAccountant, CompileSettings  # noqa: E402
from models.mesh import MeshError, join_mesh, spec_from_env  # noqa: E402
from models.sharding import check_sharding, load_sharded, shard_layout  # noqa: E402
from models.step_plan import LeaderRunner, PlanChannel, follow, rank_runner  # noqa: E402


def tampered_checks(model: torch.nn.Module, tp_size: int) -> dict[str, str]:
    """check_sharding's verdict on q_proj of layer 0 sharded twice, left whole, and replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = shard_layout(model.config)
    proj = model.model.layers[0].self_attn.q_proj  # type: ignore[union-attr, index]
    original = proj.weight
    local = original.to_local()
    full = torch.zeros(original.shape)  # values do not matter to the check (full_tensor would need rank 1)
    mesh = original.device_mesh
    variants = {
        "twice": DTensor.from_local(local[: local.shape[0] // tp_size].clone(), mesh, [Shard(0)], run_check=False),
        "whole": full.clone(),
        "replicated": DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False),
    }
    verdicts = {}
    for name, weight in variants.items():
        proj.weight = torch.nn.Parameter(weight, requires_grad=False)
        try:
            check_sharding(model, layout, tp_size)
            verdicts[name] = "accepted"
        except MeshError as exc:
            verdicts[name] = str(exc)
    proj.weight = original
    return verdicts


def main(path: str, backend: str, out: str) -> int:
    torch.set_num_threads(1)
    spec = spec_from_env(2, timeout=60.0)
    assert spec is not None
    mesh = join_mesh(spec)
    model = load_sharded(path, "float32", spec.tp_size)  # runs check_sharding on the real load
    settings = CompileSettings(backend=backend)
    runner = rank_runner(model, TABLE, settings, CompileAccountant(), mesh)
    if not isinstance(runner, LeaderRunner):
        code = follow(runner, PlanChannel(mesh), mesh)
        mesh.close()
        return code
    runner.warmup()
    tokens, logits = run_workload(runner)
    compiles = runner.heartbeat(force=True) or []
    runner.stop_followers()
    torch.save({"tokens": tokens, "logits": logits, "compiles": [c.__dict__ for c in compiles],
                "kv_heads": runner.storage.num_kv_heads, "tampered": tampered_checks(model, spec.tp_size)}, out)
    mesh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
