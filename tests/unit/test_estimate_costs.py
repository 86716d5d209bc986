"""``simulator.op_cost``: FLOPs, bytes and seconds of a traced plan's ops and reshards, per rank."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist
from mpipar.compile.plan import Plan
from mpipar.compile.trace import trace
from simulator import ShapeOnlyBackend
from simulator.cost import HardwareProfile, Link
from simulator.op_cost import PlanCosts, _contracted

PROFILE = HardwareProfile(
    "test",
    Link(1e-6, 1e10),
    Link(1e-5, 1e9),
    {"float32": 1e12, "float16": 4e12},
    devices_per_node=2,
)


def _tp_step(transpose: bool) -> Plan:
    """x (S(0) over dp) @ w (S(1) over tp), relu, @ w2 (S(0) over tp), relu, sum: on a 2 x 2 mesh, shape-only."""
    with dist.use_backend(ShapeOnlyBackend()):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
        x = dist.shard_tensor(dist.Tensor.abstract((8, 6), np.float32), mesh, [dist.Shard(0), dist.Replicate()])
        w_shape = (10, 6) if transpose else (6, 10)
        w = dist.shard_tensor(
            dist.Tensor.abstract(w_shape, np.float32), mesh, [dist.Replicate(), dist.Shard(0 if transpose else 1)]
        )
        w2 = dist.shard_tensor(dist.Tensor.abstract((10, 4), np.float32), mesh, [dist.Replicate(), dist.Shard(0)])
        for t in (w, w2):
            t.stop_gradient = False
        with trace() as rec:
            h = dist.nn.functional.relu(dist.matmul(x, w, transpose_y=transpose))
            dist.sum(dist.nn.functional.relu(dist.matmul(h, w2))).backward()  # relu all-reduces the Partial
    return rec.plan()


@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_flops_are_2mnk_on_local_shards(transpose: bool) -> None:
    plan = _tp_step(transpose)
    costs = PlanCosts(plan, PROFILE)
    fwd = [o for o in plan.ops if o.op == "matmul" and o.phase == "forward"]
    # x local (4, 6) @ w local (6, 5) -> (4, 5); then (4, 5) @ w2 local (5, 4) -> Partial (4, 4)
    assert [costs.op_flops(o, r) for o in fwd for r in range(4)] == [2 * 4 * 5 * 6] * 4 + [2 * 4 * 4 * 5] * 4
    relu = next(o for o in plan.ops if o.op == "relu")
    assert costs.op_flops(relu, 0) == 4 * 5
    assert costs.op_time(fwd[0], 0) == pytest.approx(2 * 4 * 5 * 6 / 1e12)


def test_contracted_length_reads_transposes() -> None:
    assert _contracted((4, 6), (4, 5)) == 6  # (m, k) @ (k, n)
    assert _contracted((6, 4), (4, 5)) == 6  # (k, m)^T @ (k, n)
    assert _contracted((4, 4), (4, 5)) == 4  # square: both readings agree
    assert _contracted((2, 3, 4, 6), (2, 3, 4, 5)) == 6
    assert _contracted((6,), (5,)) == 6  # (k,) @ (k, n)
    assert _contracted((4, 6), (4,)) == 6  # (m, k) @ (k,)


def test_reshard_time_is_the_collective_on_the_ranks_group() -> None:
    plan = _tp_step(False)
    costs = PlanCosts(plan, PROFILE)
    ar = next(r for r in plan.reshards if r.phase == "forward" and r.steps[0].kind == "all_reduce")
    # Partial (4, 4) float32 over tp = {0, 1} (one node): the local buffer, 64 bytes
    assert costs.reshard_time(ar, 0) == PROFILE.collective_time("all_reduce", 64, [0, 1])
    # the dp gradient all-reduce of w2 ((5, 4) local over dp = {0, 2}: two nodes, the slow link)
    grad = next(r for r in plan.reshards if "gradient of" in r.reason and r.shape == (10, 4))
    assert costs.reshard_time(grad, 1) == PROFILE.collective_time("all_reduce", 80, [1, 3])
    assert costs.reshard_time(grad, 1) > costs.reshard_time(ar, 1)


def test_transfers_cost_their_messages() -> None:
    with dist.use_backend(ShapeOnlyBackend()):
        a = dist.ProcessMesh([0, 1], dim_names=["x"])
        b = dist.ProcessMesh([2, 3], dim_names=["x"])
        t = dist.shard_tensor(dist.Tensor.abstract((8, 4), np.float16), a, [dist.Shard(0)])
        with trace() as rec:
            dist.reshard(t, b, [dist.Shard(0)])
    plan = rec.plan()
    costs = PlanCosts(plan, PROFILE)
    (r,) = plan.reshards
    one = PROFILE.p2p_time(4 * 4 * 2, 0, 2)  # a (4, 4) float16 box from rank 0 to rank 2 (another node)
    assert costs.reshard_time(r, 0) == costs.reshard_time(r, 2) == one
    assert costs.reshard_ranks(r) == (0, 1, 2, 3)


def test_bandwidth_roofline_and_overhead() -> None:
    plan = _tp_step(False)
    relu = next(o for o in plan.ops if o.op == "relu")
    flops_only = PlanCosts(plan, PROFILE).op_time(relu, 0)
    slow_memory = PlanCosts(plan, PROFILE, memory_bandwidth=1e6, op_overhead=1e-3).op_time(relu, 0)
    assert slow_memory == pytest.approx(2 * 4 * 5 * 4 / 1e6 + 1e-3)  # read and write (4, 5) float32
    assert flops_only == pytest.approx(20 / 1e12)
    with pytest.raises(ValueError, match="memory_bandwidth must be > 0"):
        PlanCosts(plan, PROFILE, memory_bandwidth=0)


def test_vector_rate_and_reshard_overhead() -> None:
    plan = _tp_step(False)
    relu = next(o for o in plan.ops if o.op == "relu")
    matmul = next(o for o in plan.ops if o.op == "matmul")
    costs = PlanCosts(plan, PROFILE, vector_flops=1e6, op_overhead=1e-5, reshard_overhead=1e-3)
    assert costs.op_time(relu, 0) == pytest.approx(20 / 1e6 + 1e-5)  # elementwise at the vector rate
    assert costs.op_time(matmul, 0) == pytest.approx(2 * 4 * 5 * 6 / 1e12 + 1e-5)  # matmul at the GEMM rate
    ar = next(r for r in plan.reshards if r.phase == "forward" and r.steps[0].kind == "all_reduce")
    assert costs.reshard_time(ar, 0) == pytest.approx(1e-3 + PROFILE.collective_time("all_reduce", 64, [0, 1]))
    assert costs.reshard_times(ar) == pytest.approx(costs.reshard_time(ar, 3))  # even shards: one number
