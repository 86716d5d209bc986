"""OneFlow's global-tensor spelling (seed 002) against the dense oracle and mpipar's own spelling."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar import oneflow as flow


def test_sbp_are_mpipar_placements() -> None:
    assert flow.sbp.split(1) == dist.Shard(1)
    assert flow.sbp.broadcast == dist.Replicate()
    assert flow.sbp.partial_sum == dist.Partial("sum")


def test_placement_maps_to_mesh_1d_and_2d() -> None:
    p1 = flow.placement("cpu", [0, 1, 2, 3])
    assert p1.mesh.shape == [4] and p1.mesh.process_ids == [0, 1, 2, 3]
    p2 = flow.placement(type="cuda", ranks=[[0, 1], [2, 3]])
    assert p2.mesh.shape == [2, 2] and p2.ranks == [[0, 1], [2, 3]] and p2.hierarchy == [2, 2]
    assert p1 != p2 and p1 == flow.placement("cpu", [0, 1, 2, 3])


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    sbps=st.lists(st.sampled_from(["s0", "s1", "b"]), min_size=2, max_size=2),
)
def test_to_global_keeps_the_value(rows: int, cols: int, sbps: list[str]) -> None:
    data = np.random.default_rng(rows * 10 + cols).standard_normal((rows, cols))
    spell = {"s0": flow.sbp.split(0), "s1": flow.sbp.split(1), "b": flow.sbp.broadcast}
    where = flow.placement("cpu", [[0, 1], [2, 3]])
    g = flow.to_global(data, where, [spell[s] for s in sbps])
    assert g.is_global and g.placement == where and g.sbp == tuple(spell[s] for s in sbps)
    np.testing.assert_array_equal(g.full_tensor(), data)
    # the method spelling and a redistribution of a global tensor give the same value
    again = g.to_global(where, [flow.sbp.broadcast, flow.sbp.split(1)])
    assert again.sbp == (dist.Replicate(), dist.Shard(1))
    np.testing.assert_array_equal(again.full_tensor(), data)


def test_to_local_is_the_rank_shard() -> None:
    data = np.arange(8.0).reshape(4, 2)
    g = dist.Tensor(data).to_global(flow.placement("cpu", [0, 1]), flow.sbp.split(0))
    np.testing.assert_array_equal(g.local_tensor(1), data[2:])
    local = dist.Tensor(data)
    assert not local.is_global and local.placement is None and local.sbp is None
    assert local.to_local() is local


def test_partial_sum_to_broadcast_is_one_all_reduce_and_matches_dense() -> None:
    x = np.random.default_rng(0).standard_normal((4, 6))
    w = np.random.default_rng(1).standard_normal((6, 3))
    where = flow.placement("cpu", [0, 1])
    gx = flow.to_global(x, where, flow.sbp.split(1))
    gw = flow.to_global(w, where, flow.sbp.split(0))
    y = dist.matmul(gx, gw)
    assert y.sbp == (dist.Partial("sum"),)
    with dist.CommDebugMode() as comm:
        z = y.to_global(where, flow.sbp.broadcast)
    assert comm.counts() == {"all_reduce": 1}
    np.testing.assert_allclose(z.full_tensor(), x @ w, rtol=1e-12)


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="type='tpu'"):
        flow.placement("tpu", [0, 1])
    with pytest.raises(ValueError, match="ranks="):
        flow.placement("cpu", [])
    with pytest.raises(ValueError, match="axis=-1"):
        flow.sbp.split(-1)
    where = flow.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"1 entries but .* 2-d"):
        flow.to_global(np.zeros((2, 2)), where, flow.sbp.broadcast)
    with pytest.raises(ValueError, match=r"sbp.split\(2\)"):
        flow.to_global(np.zeros((2, 2)), where, [flow.sbp.split(2), flow.sbp.broadcast])
    with pytest.raises(TypeError, match="not an SBP"):
        flow.to_global(np.zeros((2, 2)), where, ["S(0)", flow.sbp.broadcast])
    with pytest.raises(TypeError, match=r"flow\.placement"):
        flow.to_global(np.zeros((2, 2)), dist.ProcessMesh([0, 1]), flow.sbp.broadcast)
