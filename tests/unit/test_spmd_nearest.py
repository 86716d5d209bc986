"""``infer_backward`` answers an output layout the op cannot produce with the nearest one it can
(Paddle's behaviour): the offending mesh axis is replicated, the reason says so, and running the
op on the returned input layout gives that output layout and the dense value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar.nn import functional as F

MESH = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])


def _spec(shape: list[int], placements: list[dist.Placement]) -> dist.DistSpec:
    return dist.DistSpec(shape, MESH, placements)


@settings(max_examples=12, deadline=None)
@given(first=st.sampled_from(["S0", "S1", "R"]), axis=st.sampled_from([-1, 0]))
def test_softmax_split_on_its_axis_is_answered_with_that_axis_replicated(first: str, axis: int) -> None:
    shape = [4, 6]
    red = axis % 2
    wanted = [{"S0": dist.Shard(0), "S1": dist.Shard(1), "R": dist.Replicate()}[first], dist.Shard(red)]
    x = dist.DistSpec.from_dims_mapping(shape, MESH, [-1, -1])
    res = dist.spmd.infer_backward("softmax", [x], [_spec(shape, wanted)], axis=axis)
    # the tp axis asked to split the reduced dim: replicated; the dp axis kept unless it also splits it
    expect = [dist.Replicate() if wanted[0] == dist.Shard(red) else wanted[0], dist.Replicate()]
    assert list(res.outputs[0].placements) == expect and list(res.inputs[0].placements) == expect
    assert "must stay whole: replicated on mesh axis 'tp'" in res.reason
    # running softmax on the returned input layout produces the returned output layout, densely right
    value = np.random.default_rng(0).standard_normal(shape)
    t = dist.shard_tensor(dist.Tensor(value), MESH, list(res.inputs[0].placements))
    y = F.softmax(t, axis=axis)
    assert list(y.placements) == expect
    e = np.exp(value - value.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(y.full_tensor(), e / e.sum(axis=axis, keepdims=True), rtol=1e-12)


def test_layer_norm_split_on_the_normalised_dim_keeps_the_batch_split() -> None:
    x = dist.DistSpec.from_dims_mapping([4, 3, 8], MESH, [-1, -1, -1])
    w = dist.DistSpec.from_dims_mapping([8], MESH, [-1])
    b = dist.DistSpec.from_dims_mapping([8], MESH, [-1])
    out = _spec([4, 3, 8], [dist.Shard(0), dist.Shard(2)])
    res = dist.spmd.infer_backward(
        "layer_norm",
        [x, w, b],
        [out, _spec([4, 3], [dist.Shard(0), dist.Replicate()]), _spec([4, 3], [dist.Shard(0), dist.Replicate()])],
        begin_norm_axis=2,
    )
    assert list(res.inputs[0].placements) == [dist.Shard(0), dist.Replicate()]
    assert list(res.outputs[0].placements) == [dist.Shard(0), dist.Replicate()]
    assert "index" in res.reason and "mesh axis 'tp'" in res.reason


def test_cross_entropy_split_on_the_class_axis_is_answered_replicated() -> None:
    logits = dist.DistSpec.from_dims_mapping([8, 10], MESH, [-1, -1])
    label = dist.DistSpec.from_dims_mapping([8, 1], MESH, [-1, -1])
    soft = _spec([8, 10], [dist.Shard(0), dist.Shard(1)])
    loss = _spec([8, 1], [dist.Shard(0), dist.Replicate()])
    res = dist.spmd.infer_backward("cross_entropy_with_softmax", [logits, label], [soft, loss], axis=-1)
    assert list(res.inputs[0].placements) == [dist.Shard(0), dist.Replicate()]
    assert list(res.inputs[1].placements) == [dist.Shard(0), dist.Replicate()]
    assert list(res.outputs[0].placements) == [dist.Shard(0), dist.Replicate()]
    # the returned layout trains right: the loss on it equals the dense loss
    z = np.random.default_rng(1).standard_normal((8, 10))
    y = np.random.default_rng(2).integers(0, 10, size=(8, 1))
    tz = dist.shard_tensor(dist.Tensor(z), MESH, list(res.inputs[0].placements))
    ty = dist.shard_tensor(dist.Tensor(y), MESH, list(res.inputs[1].placements))
    got = F.cross_entropy(tz, ty, reduction="none")
    logp = z - z.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got.full_tensor()).reshape(-1), -logp[np.arange(8), y[:, 0]], rtol=1e-12)


def test_a_partial_output_the_op_cannot_commute_with_still_raises() -> None:
    out = _spec([4, 6], [dist.Partial(), dist.Replicate()])
    x = dist.DistSpec.from_dims_mapping([4, 6], MESH, [-1, -1])
    with pytest.raises(ValueError, match="does not commute"):
        dist.spmd.infer_backward("softmax", [x], [out], axis=-1)
