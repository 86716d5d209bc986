"""Hypothesis strategies and an independent oracle for distributed tensors.

``global_value(t)`` rebuilds the global value of a distributed tensor from its hosted shards
with plain NumPy -- no planner, no communicator -- so it can judge the library. It also
checks the invariant every layout promises: replicas hold identical shards.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import mpipar as dist
from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard

REDUCERS = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


@st.composite
def mesh_shapes(draw: st.DrawFn, max_ranks: int = 16, max_ndim: int = 3) -> list[int]:
    ndim = draw(st.integers(1, max_ndim))
    shape: list[int] = []
    for _ in range(ndim):
        room = max_ranks // int(np.prod(shape or [1]))
        shape.append(draw(st.integers(1, max(1, min(4, room)))))
    return shape


@st.composite
def meshes(draw: st.DrawFn, max_ranks: int = 16, max_ndim: int = 3, id_pool: int = 16) -> dist.ProcessMesh:
    shape = draw(mesh_shapes(max_ranks, max_ndim))
    n = int(np.prod(shape))
    ids = draw(st.permutations(list(range(id_pool))))[:n]
    names = ["x", "y", "z"][: len(shape)]
    return dist.ProcessMesh(np.array(ids).reshape(shape), dim_names=names)


@st.composite
def placements_for(draw: st.DrawFn, mesh: dist.ProcessMesh, ndim: int, partial: bool = True) -> list[Placement]:
    family = draw(st.sampled_from([("sum", "avg"), ("max",), ("min",), ("sum",)]))
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    if partial:
        options += [Partial(op) for op in family]
    return [draw(st.sampled_from(options)) for _ in range(mesh.ndim)]


tensor_shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3)


def natural_index(spec: dist.DistSpec) -> tuple[Any, ...]:
    """Per dim, the global position of each storage position (zigzag dims reordered), computed
    here from the placement's definition, not by the library: rank r of k holds chunks r and
    2k-1-r of 2k."""
    index: list[Any] = [slice(None)] * len(spec.shape)
    for axis, p in enumerate(spec.placements):
        k = spec.mesh.shape[axis]
        if isinstance(p, ZigzagShard) and k > 1:
            n = spec.shape[p.dim]
            c = n // (2 * k)
            order = []
            for r in range(k):
                order += list(range(r * c, (r + 1) * c)) + list(range((2 * k - 1 - r) * c, (2 * k - r) * c))
            index[p.dim] = np.array(order, dtype=np.int64)
    return tuple(index)


def _to_storage(value: np.ndarray, spec: dist.DistSpec) -> np.ndarray:
    lead = value.ndim - len(spec.shape)
    for d, idx in enumerate(natural_index(spec)):
        if not isinstance(idx, slice):
            value = np.take(value, idx, axis=lead + d)
    return value


def _to_natural(value: np.ndarray, spec: dist.DistSpec) -> np.ndarray:
    lead = value.ndim - len(spec.shape)
    for d, idx in enumerate(natural_index(spec)):
        if not isinstance(idx, slice):
            value = np.take(value, np.argsort(idx), axis=lead + d)
    return value


def make_tensor(spec: dist.DistSpec, seed: int) -> tuple[dist.Tensor, np.ndarray]:
    """A float64 tensor laid out as ``spec`` with genuinely partial shards, and its global value."""
    rng = np.random.default_rng(seed)
    p_axes = spec.partial_axes
    k = [spec.mesh.shape[a] for a in p_axes]
    # One full-size contribution per coordinate on the partial axes; replicas share it.
    contributions = rng.integers(-50, 50, size=(*k, *spec.shape)).astype(np.float64)
    if p_axes:
        contributions += rng.random(contributions.shape)
    expected = contributions
    for a in reversed(p_axes):  # reduce the last partial axis first: all families commute
        op = spec.placements[a].reduce_type  # type: ignore[union-attr]
        expected = REDUCERS[op](expected, axis=len(expected.shape) - len(spec.shape) - 1)
    if not p_axes:
        expected = contributions
    contributions = _to_storage(contributions, spec)  # the boxes are in storage order

    def local(rank: int) -> np.ndarray:
        coord = spec.mesh.coordinate(rank)
        part = contributions[tuple(coord[a] for a in p_axes)]
        return np.asarray(part[tuple(slice(s, e) for s, e in spec.local_box(rank))])

    t = dist.dtensor_from_local(local, spec.mesh, list(spec.placements), shape=spec.shape)
    return t, np.asarray(expected, dtype=np.float64)


def global_value(t: dist.Tensor) -> np.ndarray:
    """The global value of ``t`` from its hosted shards, by plain NumPy (see module doc)."""
    spec = t.spec
    p_axes = spec.partial_axes
    k = [spec.mesh.shape[a] for a in p_axes]
    parts = np.full((*k, *spec.shape), np.nan)
    seen: dict[tuple[Any, ...], np.ndarray] = {}
    for rank in spec.mesh.process_ids:
        local = np.asarray(t.local_tensor(rank))
        box = spec.local_box(rank)
        assert local.shape == spec.local_shape(rank), (rank, local.shape, spec.local_shape(rank))
        coord = spec.mesh.coordinate(rank)
        key = (tuple(coord[a] for a in p_axes), box)
        if key in seen:
            np.testing.assert_array_equal(local, seen[key], err_msg=f"replica on rank {rank} differs")
            continue
        seen[key] = local
        parts[key[0] + tuple(slice(s, e) for s, e in box)] = local
    assert not np.isnan(parts).any(), "some element is held by no rank"
    value = _to_natural(parts, spec)
    for a in reversed(p_axes):
        op = spec.placements[a].reduce_type  # type: ignore[union-attr]
        value = REDUCERS[op](value, axis=len(value.shape) - len(spec.shape) - 1)
    return np.asarray(value)
