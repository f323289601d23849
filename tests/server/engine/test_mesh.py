"""Rank 0's view of the ranks' compilations: a follower's compile after warm-up is a recompile."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from models.mesh import MeshSpec
from models.step_plan import RankCompiles
from server.engine.mesh import EngineMesh
from server.metrics.prometheus import Metrics
from tests.support.tiny import TINY_TABLE


def _metrics() -> Metrics:
    return Metrics(CollectorRegistry(), TINY_TABLE, world_size=2,
                   info={"model": "m", "dtype": "float32", "device": "cpu", "compile_backend": "eager"})


def _value(m: Metrics, name: str, **labels: str) -> float:
    got = m.registry.get_sample_value(name, labels)
    assert got is not None, (name, labels)
    return got


def test_follower_compiles_after_warm_up_count_as_recompilations() -> None:
    mesh, metrics = EngineMesh(MeshSpec(tp_size=2, world_size=2, rank=0)), _metrics()
    mesh._update([RankCompiles(0, 10, 0, 0), RankCompiles(1, 8, 0, 0)], metrics)
    assert _value(metrics, "bucketserve_recompilations_total", reason="other_rank") == 0
    mesh._update([RankCompiles(0, 10, 0, 0), RankCompiles(1, 8, 2, 0)], metrics)
    mesh._update([RankCompiles(0, 10, 0, 0), RankCompiles(1, 8, 3, 0)], metrics)
    assert _value(metrics, "bucketserve_recompilations_total", reason="other_rank") == 3
    assert _value(metrics, "bucketserve_rank_compilations", rank="1", phase="serving") == 3
    assert _value(metrics, "bucketserve_rank_compilations", rank="1", phase="warmup") == 8
    info = mesh.info()
    assert info["tensor_parallel_size"] == 2 and info["ranks"][1] == {
        "rank": 1, "compilations_warmup": 8, "compilations_serving": 3, "refused": 0}
