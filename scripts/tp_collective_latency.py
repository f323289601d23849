"""Round-trip time of the collectives a tensor-parallel decode step runs, on this machine: gloo between two
processes on 127.0.0.1. Usage: python scripts/tp_collective_latency.py [iterations]

A decode step of a Llama-shaped model with L layers runs 2L + 2 all-reduces (after o_proj and down_proj in
every layer, after the vocabulary-sharded embedding, and the LM head's gather) plus the step plan's broadcast;
the step's cost over TP=1 is about that many times one round trip, plus waiting for the slower rank.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, iterations: int, out: dict[str, float]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hidden = torch.zeros(4, 576)  # a decode step's activations: batch 4, hidden 576
    results = {}
    for name, op in (("all_reduce [4, 576] fp32", lambda: dist.all_reduce(hidden)),
                     ("broadcast_object_list (decode plan)", lambda: dist.broadcast_object_list(
                         [(4, 512, tuple(range(4)), tuple(range(4)))], src=0))):
        for _ in range(50):
            op()
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        results[name] = statistics.median(times) * 1e6
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def main(iterations: int = 2000) -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, iterations, out), nprocs=2)
        for name, us in out.items():
            print(f"{name}: median {us:.0f} us over {iterations}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:2])))
