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


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 7),
    cols=st.integers(1, 7),
    sbps=st.lists(st.sampled_from(["s0", "s1", "b"]), min_size=2, max_size=2),
)
def test_randn_global_is_the_one_device_draw(rows: int, cols: int, sbps: list[str]) -> None:
    """Each rank draws only its shard, and the global value is what one device draws."""
    spell = {"s0": flow.sbp.split(dim=0), "s1": flow.sbp.split(1), "b": flow.sbp.broadcast}
    where = flow.placement("cuda", [[0, 1], [2, 3]])
    flow.manual_seed(7)
    g = flow.randn(rows, cols, dtype="float64", placement=where, sbp=[spell[s] for s in sbps])
    flow.manual_seed(7)
    dense = flow.randn((rows, cols), dtype="float64")
    assert not dense.is_global and g.is_global and g.sbp == tuple(spell[s] for s in sbps)
    np.testing.assert_array_equal(g.full_tensor(), dense.numpy())
    assert g.dtype == np.float64 and g.shape == [rows, cols]


def test_factories_and_seed_examples_spelling() -> None:
    where = flow.placement("cpu", [0, 1])
    z = flow.zeros(4, 3, placement=where, sbp=flow.sbp.split(0))
    o = flow.ones([2, 5], dtype="float64", placement=where, sbp=flow.sbp.broadcast)
    t = flow.tensor([[1.0, 2.0], [3.0, 4.0]], placement=where, sbp=flow.sbp.split(dim=1), requires_grad=True)
    np.testing.assert_array_equal(z.full_tensor(), np.zeros((4, 3)))
    np.testing.assert_array_equal(o.full_tensor(), np.ones((2, 5)))
    assert o.dtype == np.float64 and t.local_tensor(1).tolist() == [[2.0], [4.0]]
    assert not t.stop_gradient and z.stop_gradient
    assert flow.sbp.split(dim=1) == flow.sbp.split(1) == dist.Shard(1)
    # a global tensor's placement reports the ranks it was given
    assert t.placement.ranks == [0, 1] and t.placement.hierarchy == [2]


def test_optim_sgd_trains_like_mpipars_sgd() -> None:
    where = flow.placement("cpu", [0, 1])
    x = np.random.default_rng(3).standard_normal((4, 5))
    w0 = np.random.default_rng(4).standard_normal((5, 8))
    losses = []
    for spelling in ("oneflow", "mpipar"):
        gx = flow.to_global(x, where, flow.sbp.split(0))
        w = flow.to_global(w0, where, flow.sbp.broadcast)
        w.stop_gradient = False
        opt = flow.optim.SGD([w], lr=0.1) if spelling == "oneflow" else dist.optimizer.SGD(0.1, parameters=[w])
        run = []
        for _ in range(3):
            out = flow.matmul(gx, w)
            loss = (out * out).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            run.append(float(loss))
        losses.append(run)
    assert losses[0] == losses[1]
    # the dense oracle: gradient descent on mean((x w)^2)
    w, want = w0.copy(), []
    for _ in range(3):
        out = x @ w
        want.append(float((out * out).mean()))
        w -= 0.1 * x.T @ (2 * out / out.size)
    np.testing.assert_allclose(losses[0], want, rtol=1e-12)


def test_factory_bad_input_names_the_field() -> None:
    where = flow.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match=r"randn: size \[4, -1\] has -1"):
        flow.randn(4, -1)
    with pytest.raises(ValueError, match="placement and sbp together"):
        flow.randn(4, 2, placement=where)
    with pytest.raises(ValueError, match="tensor: data"):
        flow.tensor(["a", "b"])
    with pytest.raises(TypeError, match=r"split\(axis\) or split\(dim=axis\)"):
        flow.sbp.split(0, dim=1)
    with pytest.raises(ValueError, match="momentum"):
        flow.optim.SGD([flow.zeros(2, requires_grad=True)], lr=0.1, momentum=0.9)
