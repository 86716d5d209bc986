"""Reshard equivalence: any source layout to any destination layout keeps the global value.

Meshes up to 3-d and 16 ranks, shapes with uneven and empty shards, every placement including
Partial with each reduce type, same-mesh and cross-mesh pairs (other ids, other shapes,
overlapping process sets). The oracle is ``strategies.global_value`` (plain NumPy).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import global_value, make_tensor, meshes, placements_for, tensor_shapes

import mpipar as dist
from mpipar.tensor_text import held_value


def _check(src: dist.DistSpec, dst: dist.DistSpec, seed: int) -> None:
    t, expected = make_tensor(src, seed)
    np.testing.assert_allclose(global_value(t), expected, rtol=1e-12, atol=1e-12)
    out = dist.reshard(t, dst.mesh, list(dst.placements))
    assert out.spec == dst
    got = global_value(out)
    if src.is_partial or dst.is_partial:  # reductions round; avg partials rescale
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(out.full_tensor(), expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=600)
@given(st.data(), tensor_shapes, st.integers(0, 2**31 - 1))
def test_same_mesh(data: st.DataObject, shape: list[int], seed: int) -> None:
    mesh = data.draw(meshes())
    src = dist.DistSpec(shape, mesh, data.draw(placements_for(mesh, len(shape))))
    dst = dist.DistSpec(shape, mesh, data.draw(placements_for(mesh, len(shape))))
    _check(src, dst, seed)


@settings(max_examples=400)
@given(st.data(), tensor_shapes, st.integers(0, 2**31 - 1))
def test_cross_mesh(data: st.DataObject, shape: list[int], seed: int) -> None:
    mesh0 = data.draw(meshes())
    mesh1 = data.draw(meshes())
    src = dist.DistSpec(shape, mesh0, data.draw(placements_for(mesh0, len(shape))))
    dst = dist.DistSpec(shape, mesh1, data.draw(placements_for(mesh1, len(shape))))
    _check(src, dst, seed)


@settings(max_examples=100)
@given(st.data(), st.lists(st.integers(0, 9), min_size=1, max_size=3), st.integers(0, 2**31 - 1))
def test_chains_of_reshards(data: st.DataObject, shape: list[int], seed: int) -> None:
    """Several reshards in a row, mixing meshes, end at the same value."""
    t, expected = make_tensor(_start(data, shape), seed)
    for _ in range(3):
        mesh = data.draw(meshes(max_ranks=8))
        t = dist.reshard(t, mesh, data.draw(placements_for(mesh, len(shape))))
    np.testing.assert_allclose(global_value(t), expected, rtol=1e-12, atol=1e-12)


def _start(data: st.DataObject, shape: list[int]) -> dist.DistSpec:
    mesh = data.draw(meshes(max_ranks=8))
    return dist.DistSpec(shape, mesh, data.draw(placements_for(mesh, len(shape))))


def test_marking_in_place_keeps_identity_and_value() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    value = np.arange(30.0).reshape(5, 6)
    w = dist.Parameter(value)
    same = dist.shard_tensor(w, mesh, [dist.Shard(0), dist.Partial()])
    assert same is w and isinstance(w, dist.Parameter) and isinstance(w, dist.DistTensor)
    dist.shard_tensor(w, mesh, [dist.Shard(1), dist.Shard(0)])  # re-mark: an in-place reshard
    assert w.placements == [dist.Shard(1), dist.Shard(0)]
    np.testing.assert_array_equal(global_value(w), value)
    assert not isinstance(dist.to_tensor(value), dist.DistTensor)


@settings(max_examples=150)
@given(st.data(), tensor_shapes, st.integers(0, 2**31 - 1))
def test_printing_reassembles_the_held_shards_without_communicating(
    data: st.DataObject, shape: list[int], seed: int
) -> None:
    """``print(t)`` shows the global value made from the shards this process holds: all of them
    in the simulator; under MPI one rank's, which determine the value only when every mesh axis
    of more than one rank replicates it (else the rank's piece prints, labelled)."""
    mesh = data.draw(meshes(max_ranks=8))
    spec = dist.DistSpec(shape, mesh, data.draw(placements_for(mesh, len(shape))))
    t, expected = make_tensor(spec, seed)
    with dist.CommDebugMode() as comm:
        text = str(t)
        whole = held_value(spec, {r: t.local_tensor(r) for r in t.hosted_ranks})
    assert not comm.events
    assert whole is not None and "GlobalDenseTensor=" in text
    np.testing.assert_allclose(whole, expected, rtol=1e-12, atol=1e-12)
    rank = data.draw(st.sampled_from(mesh.process_ids))
    alone = held_value(spec, {rank: t.local_tensor(rank)})
    determined = all(p.is_replicated() or n == 1 for p, n in zip(spec.placements, mesh.shape, strict=True))
    assert (alone is not None) == determined
    if alone is not None:
        np.testing.assert_allclose(alone, expected, rtol=1e-12, atol=1e-12)
