"""Mesh layout and join: the numbers in every error, and bounded waits for ranks that never come."""

from __future__ import annotations

import time

import pytest

from models.mesh import MeshError, MeshSpec, join_mesh, spec_from_env
from tests.models.tp_support import free_port


def test_product_of_parallel_dims_must_equal_world_size() -> None:
    with pytest.raises(MeshError, match=r"tp=2 x pp=1 x dp=1 need 2 processes, but the world size is 3"):
        MeshSpec(tp_size=2, world_size=3, rank=0)
    assert MeshSpec(tp_size=2, world_size=2, rank=1).dims == (("tp", 2), ("pp", 1), ("dp", 1))


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(MeshError, match="rank 2 is outside the world of 2 ranks"):
        MeshSpec(tp_size=2, world_size=2, rank=2)


def test_spec_from_torchrun_variables() -> None:
    assert spec_from_env(2, 5.0, {}) is None
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    spec = spec_from_env(2, 5.0, env)
    assert spec is not None
    assert (spec.rank, spec.world_size, spec.master_addr, spec.master_port, spec.uses_agent_store) == (
        1, 2, "10.0.0.1", 1234, True)
    with pytest.raises(MeshError, match="world size is 4"):
        spec_from_env(2, 5.0, {**env, "WORLD_SIZE": "4"})
    assert spec.env(0)["RANK"] == "0" and spec.env(0)["MASTER_PORT"] == "1234"


def test_rank_zero_names_the_ranks_that_never_join_within_the_timeout() -> None:
    spec = MeshSpec(tp_size=4, world_size=4, rank=0, master_port=free_port(), timeout=1.0)
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"ranks \[1, 2, 3\] of 4 did not join the mesh .* within 1 s \(joined: \[0\]\)"):
        join_mesh(spec)
    assert time.monotonic() - start < 10


def test_follower_gives_up_on_a_missing_rank_zero_within_the_timeout() -> None:
    spec = MeshSpec(tp_size=2, world_size=2, rank=1, master_port=free_port(), timeout=1.0)
    start = time.monotonic()
    with pytest.raises(MeshError, match="rank 1 could not reach rank 0's store at 127.0.0.1:.* within 1 s"):
        join_mesh(spec)
    assert time.monotonic() - start < 10
