"""Pinned collectives of the classic parallel patterns: which communication each layout costs, and that
the values and gradients equal the dense ones."""

from __future__ import annotations

import contextlib

import numpy as np

import mpipar as dist

F = dist.nn.functional


def _mlp(x: dist.Tensor, w0: dist.Tensor, w1: dist.Tensor) -> dist.Tensor:
    return dist.mean(F.relu(dist.matmul(F.relu(dist.matmul(x, w0)), w1)))


def test_column_then_row_parallel_mlp_one_all_reduce_each_way() -> None:
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    rng = np.random.default_rng(0)
    x_val, w0_val, w1_val = rng.standard_normal((8, 16)), rng.standard_normal((16, 32)), rng.standard_normal((32, 16))
    x = dist.shard_tensor(x_val, mesh, [dist.Replicate()], stop_gradient=False)
    w0 = dist.shard_tensor(dist.Parameter(w0_val), mesh, [dist.Shard(1)])  # column parallel
    w1 = dist.shard_tensor(dist.Parameter(w1_val), mesh, [dist.Shard(0)])  # row parallel
    with dist.CommDebugMode() as fwd:
        loss = _mlp(x, w0, w1)
    assert fwd.counts() == {"all_reduce": 1}
    assert "relu input 0" in fwd.events[0].context  # the non-linear op asked for it
    with dist.CommDebugMode() as bwd:
        loss.backward()
    assert bwd.counts() == {"all_reduce": 1}  # x's gradient (dx is Partial after the column matmul)
    assert w0.grad.placements == [dist.Shard(1)] and w1.grad.placements == [dist.Shard(0)]
    # gradients equal the dense ones
    xd, w0d, w1d = dist.Tensor(x_val, stop_gradient=False), dist.Parameter(w0_val), dist.Parameter(w1_val)
    _mlp(xd, w0d, w1d).backward()
    for got, want in ((x, xd), (w0, w0d), (w1, w1d)):
        np.testing.assert_allclose(got.grad.full_tensor(), want.grad.full_tensor(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        loss.full_tensor(), _mlp(dist.Tensor(x_val), dist.Tensor(w0_val), dist.Tensor(w1_val)).full_tensor(), rtol=1e-12
    )


def test_data_parallel_one_all_reduce_per_parameter() -> None:
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    rng = np.random.default_rng(1)
    x = dist.shard_tensor(rng.standard_normal((8, 6)), mesh, [dist.Shard(0)])
    w0 = dist.shard_tensor(dist.Parameter(rng.standard_normal((6, 5)), name="w0"), mesh, [dist.Replicate()])
    b0 = dist.shard_tensor(dist.Parameter(rng.standard_normal((5,)), name="b0"), mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((5, 3)), name="w1"), mesh, [dist.Replicate()])
    with dist.CommDebugMode() as fwd:
        loss = dist.mean(dist.matmul(F.relu(dist.add(dist.matmul(x, w0), b0)), w1))
    assert fwd.counts() == {}
    with dist.CommDebugMode() as bwd, dist.overlap_grad_reduction(None):  # the default buckets off
        loss.backward()
    assert bwd.counts() == {"all_reduce": 3}
    reasons = sorted(e.context for e in bwd.events)
    assert all("gradient of" in r for r in reasons)
    assert any("'w0'" in r for r in reasons) and any("'b0'" in r for r in reasons)


def test_data_parallel_gradients_travel_in_one_default_bucket_with_the_same_bits() -> None:
    """By default (as Paddle's DataParallel and PyTorch's DDP) gradients are reduced in 25 MiB
    buckets while backward runs: the three gradients above take one all-reduce of their bytes
    together, and come out bit for bit as their own all-reduces give them."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["dp"])
    grads = {}
    for off in (False, True):
        rng = np.random.default_rng(1)
        x = dist.shard_tensor(rng.standard_normal((8, 6)), mesh, [dist.Shard(0)])
        ps = [
            dist.shard_tensor(dist.Parameter(rng.standard_normal(shape)), mesh, [dist.Replicate()])
            for shape in ((6, 5), (5,), (5, 3))
        ]
        loss = dist.mean(dist.matmul(F.relu(dist.add(dist.matmul(x, ps[0]), ps[1])), ps[2]))
        with dist.CommDebugMode() as bwd, dist.overlap_grad_reduction(None) if off else contextlib.nullcontext():
            loss.backward()
        assert bwd.counts() == {"all_reduce": 3 if off else 1}
        assert sum(e.input_nbytes for e in bwd.events) == (30 + 5 + 15) * 8
        grads[off] = [p.grad.full_tensor() for p in ps]
    for a, b in zip(grads[False], grads[True], strict=True):
        assert np.array_equal(a, b)


def test_shard_times_replicate_matmul_needs_no_communication() -> None:
    mesh = dist.ProcessMesh([0, 1, 2], dim_names=["x"])
    a = dist.shard_tensor(np.ones((7, 4)), mesh, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((4, 5)), mesh, [dist.Replicate()])
    with dist.CommDebugMode() as comm:
        c = dist.matmul(a, b)
    assert comm.counts() == {} and c.placements == [dist.Shard(0)]


def test_seed_example_partial_then_allreduce() -> None:
    """Seed 000 §3: A replicated, B row-split: A is sliced, C is Partial, relu all-reduces."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    a = dist.shard_tensor(np.array([[1.0, 2], [3, 4]]), mesh, [dist.Replicate()])
    b = dist.shard_tensor(np.array([[5.0, 6], [7, 8]]), mesh, [dist.Shard(0)])
    with dist.CommDebugMode() as comm:
        c = dist.matmul(a, b)
        assert c.placements == [dist.Partial()]
        d = F.relu(c)
    assert d.placements == [dist.Replicate()]
    assert comm.counts() == {"all_reduce": 1}
    np.testing.assert_array_equal(d.full_tensor(), [[19, 22], [43, 50]])


def test_a_partial_is_kept_through_a_matmul_only_when_deferring_its_reduction_is_cheaper() -> None:
    """The row-parallel backward: a tp-partial output gradient (tokens, h) times the column-split
    weight (4h, h) transposed, with more tokens than the weight has rows (so gathering the weight
    receives fewer bytes than reducing the gradient). Keeping it Partial would gather the weight
    and leave every rank a (tokens, 4h) Partial to reduce later, 4x the bytes: the rule reduces
    the gradient now and splits the product by the weight's columns, as Megatron's backward
    does. Where nothing needs gathering and the product is smaller than the Partial it came
    from, deferring is cheaper and the Partial is kept."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["tp"])
    gout = dist.DistSpec([64, 8], mesh, [dist.Partial()])
    w = dist.DistSpec([32, 8], mesh, [dist.Shard(0)])
    res = dist.spmd.infer_forward("matmul", [gout, w], trans_x=False, trans_y=True)
    assert [str(s.placements[0]) for s in res.inputs] == ["R", "S(0)"]
    assert res.outputs[0].placements == (dist.Shard(1),)

    shrinking = dist.spmd.infer_forward(
        "matmul", [dist.DistSpec([32, 64], mesh, [dist.Partial()]), dist.DistSpec([64, 16], mesh, [dist.Replicate()])]
    )
    assert shrinking.outputs[0].placements == (dist.Partial(),)
    assert shrinking.inputs[0].placements == (dist.Partial(),)

    # executed: the same numbers as the dense product, and one all_reduce of the (64, 8) gradient
    rng = np.random.default_rng(0)
    parts, wv = rng.standard_normal((4, 64, 8)), rng.standard_normal((32, 8))
    g = dist.dtensor_from_local(lambda r: parts[r], mesh, [dist.Partial()], shape=[64, 8])
    wt = dist.shard_tensor(wv, mesh, [dist.Shard(0)])
    with dist.CommDebugMode() as comm:
        out = dist.matmul(g, wt, transpose_y=True)
    assert comm.counts() == {"all_reduce": 1}
    np.testing.assert_allclose(out.full_tensor(), parts.sum(0) @ wv.T, rtol=1e-12)
