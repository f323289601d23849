"""One rank of a 2-process tensor-parallel run of tp_workload (started by test_tensor_parallel.py).

argv: checkpoint dir, compile backend, output file (rank 0 writes tokens, logits and per-rank compile counts).
The mesh comes from torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models.compile import CompileAccountant, CompileSettings  # noqa: E402
from models.mesh import join_mesh, spec_from_env  # noqa: E402
from models.runner import ModelRunner  # noqa: E402
from models.sharding import load_sharded  # noqa: E402
from models.step_plan import LeaderRunner, PlanChannel, follow  # noqa: E402
from tp_workload import TABLE, run_workload  # noqa: E402


def main(path: str, backend: str, out: str) -> int:
    torch.set_num_threads(1)
    spec = spec_from_env(2, timeout=60.0)
    assert spec is not None
    mesh = join_mesh(spec)
    model = load_sharded(path, "float32", spec.tp_size)
    settings = CompileSettings(backend=backend)
    if not spec.is_leader:
        runner = ModelRunner(model, TABLE, settings, CompileAccountant(), tp_size=spec.tp_size)
        code = follow(runner, PlanChannel(mesh), mesh)
        mesh.close()
        return code
    leader = LeaderRunner(model, TABLE, settings, CompileAccountant(), mesh)
    leader.warmup()
    tokens, logits = run_workload(leader)
    compiles = leader.heartbeat(force=True) or []
    leader.stop_followers()
    torch.save({"tokens": tokens, "logits": logits, "compiles": [c.__dict__ for c in compiles]}, out)
    mesh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
