"""Each reshard once: a value resharded to a layout is not resharded to it again by a later
consumer (forward or backward) until it changes; the conflict policy prices such a reshard as
free. Collective counts are pinned with reuse on and off; values equal the dense oracle and are
bit-identical with reuse on and off."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.tensor import reuse_reshards

F = dist.nn.functional


def _tp_mlp_step(reuse: bool) -> tuple[dist.CommDebugMode, list[np.ndarray]]:
    """The tensor-parallel MLP training step (Megatron layout, loss mean(y*y), SGD), smaller, float64."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    rng = np.random.default_rng(0)
    x = dist.shard_tensor(rng.standard_normal((32, 16)), mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((16, 64))), mesh, [dist.Shard(1)])
    w2 = dist.shard_tensor(dist.Parameter(rng.standard_normal((64, 16))), mesh, [dist.Shard(0)])
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w1, w2])
    with reuse_reshards(reuse), dist.CommDebugMode() as comm:
        y = dist.matmul(F.relu(dist.matmul(x, w1)), w2)
        loss = dist.mean(dist.multiply(y, y))
        loss.backward()
        opt.step()
    return comm, [loss.full_tensor(), w1.full_tensor(), w2.full_tensor()]


def _dense_tp_mlp_step() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    x, w1, w2 = rng.standard_normal((32, 16)), rng.standard_normal((16, 64)), rng.standard_normal((64, 16))
    h = np.maximum(x @ w1, 0)
    y = h @ w2
    loss = np.mean(y * y)
    gy = 2 * y / y.size
    gw2 = h.T @ gy
    gw1 = x.T @ ((gy @ w2.T) * (h > 0))
    return [np.asarray(loss), w1 - 0.1 * gw1, w2 - 0.1 * gw2]


def test_tp_mlp_step_makes_exactly_one_all_reduce() -> None:
    comm, values = _tp_mlp_step(reuse=True)
    assert comm.counts() == {"all_reduce": 1}
    assert "multiply input 0" in comm.events[0].context
    # The second input of multiply(y, y) used the first one's reshard: shown, not counted.
    assert len(comm.reused) == 1 and "multiply input 1" in comm.reused[0].context
    assert (comm.reused[0].src, comm.reused[0].dst) == ("P(sum)", "R")
    assert "reused P(sum) -> R float64 (no call)" in comm.table()
    for got, want in zip(values, _dense_tp_mlp_step(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_tp_mlp_step_without_reuse_made_three_and_gives_the_same_values() -> None:
    comm, values = _tp_mlp_step(reuse=False)
    # Without reuse: y kept Partial through multiply, its gradient reduced per matmul.
    assert comm.counts() == {"all_reduce": 3} and comm.reused == []
    for got, want in zip(values, _dense_tp_mlp_step(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_partial_gradient_read_by_two_backward_matmuls_is_reduced_once() -> None:
    # z Partial feeds two matmuls that each want it Replicate: forward reshards z once.
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    rng = np.random.default_rng(2)
    a = dist.shard_tensor(rng.standard_normal((6, 8)), mesh, [dist.Shard(1)])
    b = dist.shard_tensor(dist.Parameter(rng.standard_normal((8, 5))), mesh, [dist.Shard(0)])
    z = dist.matmul(a, b)
    assert z.placements == [dist.Partial()]
    with dist.CommDebugMode() as comm:
        first = dist.reshard(z, mesh, [dist.Replicate()])
        second = dist.reshard(z, mesh, [dist.Replicate()])
    assert comm.counts() == {"all_reduce": 1} and len(comm.reused) == 1
    np.testing.assert_array_equal(first.full_tensor(), second.full_tensor())
    # Gradients through both uses reach b once each, summed: d(sum(2 z))/db.
    dist.sum(dist.add(first, second)).backward()
    want = 2 * a.full_tensor().T @ np.ones((6, 5))
    np.testing.assert_allclose(b.grad.full_tensor(), want, rtol=1e-12)


def test_a_changed_value_is_resharded_again() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
    a = dist.shard_tensor(np.arange(12.0).reshape(3, 4), mesh, [dist.Shard(1)])
    b = dist.shard_tensor(np.ones((4, 2)), mesh, [dist.Shard(0)])
    z = dist.matmul(a, b)  # Partial
    with dist.CommDebugMode() as comm:
        dist.reshard(z, mesh, [dist.Replicate()])
        # In place, as an optimizer updates a tensor: z becomes another value (a new storage id).
        z._take_storage(dist.matmul(dist.multiply(a, 2.0), b))
        again = dist.reshard(z, mesh, [dist.Replicate()])
    assert comm.counts() == {"all_reduce": 2} and comm.reused == []
    np.testing.assert_array_equal(again.full_tensor(), 2 * np.arange(12.0).reshape(3, 4) @ np.ones((4, 2)))


def test_parameters_keep_no_resharded_copy() -> None:
    # A leaf is resharded each time (a gathered parameter must not outlive its use: ZeRO-3).
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    w = dist.shard_tensor(dist.Parameter(np.arange(8.0)), mesh, [dist.Shard(0)])
    with dist.CommDebugMode() as comm:
        dist.reshard(w, mesh, [dist.Replicate()])
        dist.reshard(w, mesh, [dist.Replicate()])
    assert comm.counts() == {"all_gather": 2} and w._reshards is None


@pytest.mark.parametrize("op", ["multiply", "add", "subtract"])
@pytest.mark.parametrize("placement", [dist.Partial(), dist.Shard(0), dist.Shard(1), dist.Replicate()])
def test_binary_op_on_one_value_twice_equals_dense(op: str, placement: dist.Placement) -> None:
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    rng = np.random.default_rng(5)
    a_val, b_val = rng.standard_normal((6, 9)), rng.standard_normal((9, 6))
    # y = a @ b with the contraction split gives Partial; other layouts by reshard.
    a = dist.shard_tensor(dist.Parameter(a_val), mesh, [dist.Shard(1)])
    b = dist.shard_tensor(b_val, mesh, [dist.Shard(0)])
    y = dist.matmul(a, b)
    if not isinstance(placement, dist.Partial):
        y = dist.reshard(y, mesh, [placement])
    with dist.CommDebugMode() as comm:
        out = getattr(dist, op)(y, y)
        dist.sum(out).backward()
    dense_y = a_val @ b_val
    dense = {"multiply": dense_y * dense_y, "add": 2 * dense_y, "subtract": 0 * dense_y}[op]
    np.testing.assert_allclose(out.full_tensor(), dense, rtol=1e-12, atol=1e-12)
    gy = {"multiply": 2 * dense_y, "add": np.full_like(dense_y, 2.0), "subtract": np.zeros_like(dense_y)}[op]
    np.testing.assert_allclose(a.grad.full_tensor(), gy @ b_val.T, rtol=1e-12, atol=1e-12)
    if op == "multiply" and isinstance(placement, dist.Partial):
        # one reduction of y, reused by the second input; backward is local but the leaf's own.
        assert comm.counts() == {"all_reduce": 1} and len(comm.reused) == 1


CFG = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0, dtype="float64")


def _gpt_steps(sequence_parallel: bool, reuse: bool) -> tuple[list[dict[str, int]], list[float]]:
    par = GPTParallel.from_degrees(2, 2, 1, sequence_parallel=sequence_parallel)
    dist.seed(3)
    model = GPT(CFG, par)
    opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    rng = np.random.default_rng(0)
    mesh = par.stage_meshes[0]
    counts, losses = [], []
    # One all-reduce per gradient (the default buckets off): the counts below are per reshard.
    with reuse_reshards(reuse), dist.overlap_grad_reduction(None):
        for _ in range(2):
            x = dist.shard_tensor(rng.integers(0, 40, (4, 8)), mesh, [dist.Shard(0), dist.Replicate()])
            y = dist.shard_tensor(rng.integers(0, 40, (4, 8)), mesh, [dist.Shard(0), dist.Replicate()])
            with dist.CommDebugMode() as comm:
                loss = model.loss(x, y)
                loss.backward()
            opt.step()
            opt.clear_grad()
            counts.append(comm.counts())
            losses.append(float(loss.full_tensor()))
    return counts, losses


@pytest.mark.parametrize(
    ("sequence_parallel", "before", "after"),
    [
        # The vocabulary-split output layer (lm_head Shard(1) on tp) adds the loss's all_to_all
        # and the logits' reduce_scatter; reuse drops what it dropped before.
        (
            False,
            {"all_reduce": 89, "all_to_all": 4, "reduce_scatter": 4},
            {"all_reduce": 81, "all_to_all": 4, "reduce_scatter": 4},
        ),
        (
            True,
            {"all_gather": 38, "all_reduce": 64, "all_to_all": 16, "reduce_scatter": 30},
            {"all_gather": 18, "all_reduce": 64, "all_to_all": 12, "reduce_scatter": 30},
        ),
    ],
)
def test_gpt_step_collectives_drop_and_losses_stay_bit_identical(
    sequence_parallel: bool, before: dict[str, int], after: dict[str, int]
) -> None:
    counts_off, losses_off = _gpt_steps(sequence_parallel, reuse=False)
    counts_on, losses_on = _gpt_steps(sequence_parallel, reuse=True)
    assert counts_off == [before, before]
    assert counts_on == [after, after]
    assert losses_on == losses_off  # bit-identical, not close
