"""DistSpec: the chunking rule, nested sharding, boxes, Paddle's dims_mapping, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpipar as dist
from mpipar.spec import box_numel, chunk_range


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunks_tile_and_follow_array_split(size: int, parts: int) -> None:
    ranges = [chunk_range(size, parts, i) for i in range(parts)]
    expected = np.array_split(np.arange(size), parts)
    for (s, e), ref in zip(ranges, expected, strict=True):
        assert list(range(s, e)) == ref.tolist()
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(parts - 1))


def test_nested_table_from_the_docs() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    spec = dist.DistSpec([5], mesh, [dist.Shard(0), dist.Shard(0)])
    assert [spec.local_box(r) for r in range(4)] == [((0, 2),), ((2, 3),), ((3, 4),), ((4, 5),)]
    assert spec.shard_axes(0) == (0, 1)


def test_seed_example_local_shapes() -> None:
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    spec = dist.DistSpec([4, 3], mesh, [dist.Shard(0), dist.Shard(1)])
    assert all(spec.local_shape(r) == (2, 1) for r in mesh.process_ids)
    assert spec.local_box(1) == ((2, 4), (1, 2))


@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.lists(st.integers(0, 6), min_size=0, max_size=3),
    st.data(),
)
def test_boxes_cover_the_tensor(mesh_shape: list[int], shape: list[int], data: st.DataObject) -> None:
    mesh = dist.ProcessMesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape))
    choices = [dist.Replicate(), dist.Partial()] + [dist.Shard(d) for d in range(len(shape))]
    pls = [data.draw(st.sampled_from(choices)) for _ in mesh_shape]
    spec = dist.DistSpec(shape, mesh, pls)
    replicas = int(np.prod([mesh.shape[a] for a, p in enumerate(pls) if not p.is_shard()]))
    covered = np.zeros(shape, dtype=int)
    for box in spec.boxes.values():
        covered[tuple(slice(s, e) for s, e in box)] += 1
    assert (covered == replicas).all()
    assert sum(box_numel(b) * len(rs) for b, rs in spec.cells.items()) == spec.numel * replicas


def test_dims_mapping_round_trip() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    spec = dist.DistSpec.from_dims_mapping([4, 6, 8], mesh, [-1, 0, 1])
    assert spec.placements == (dist.Shard(1), dist.Shard(2))
    assert spec.dims_mapping == [-1, 0, 1] and spec.partial_dims == []
    p = dist.DistSpec.from_dims_mapping([4, 6], mesh, [0, -1], partial_dims=[1])
    assert p.placements == (dist.Shard(0), dist.Partial("sum"))
    assert p.partial_dims == [1]
    with pytest.raises(ValueError, match="nested sharding"):
        _ = dist.DistSpec([4], mesh, [dist.Shard(0), dist.Shard(0)]).dims_mapping


def test_negative_shard_dim_is_normalised() -> None:
    mesh = dist.ProcessMesh([0, 1])
    assert dist.DistSpec([3, 4], mesh, [dist.Shard(-1)]).placements == (dist.Shard(1),)


@pytest.mark.parametrize(
    ("shape", "pls", "message"),
    [
        ([4, 3], [dist.Shard(0)], r"1 placements S\(0\) given for mesh .* with 2 axes"),
        (
            [4, 3],
            [dist.Shard(2), dist.Replicate()],
            r"Shard\(2\) on mesh axis 0 \('x'\) names tensor dim 2, but the tensor of shape \[4, 3\] has 2 dims",
        ),
        ([4, 3], [dist.Partial("max"), dist.Partial("sum")], "do not commute"),
        ([4, -3], [dist.Replicate(), dist.Replicate()], "negative"),
        ([4, 3], [dist.Replicate(), "S(0)"], r"placements\[1\] is 'S\(0\)'"),
    ],
)
def test_bad_specs(shape: list[int], pls: list[object], message: str) -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    with pytest.raises((ValueError, TypeError), match=message):
        dist.DistSpec(shape, mesh, pls)  # type: ignore[arg-type]


def test_interned_specs_are_one_object_per_value() -> None:
    """``interned``: equal specs give one object (so hot paths compare by identity), unequal
    ones their own; the table keeps none alive by itself (a large mesh's boxes are big)."""
    from mpipar.spec import interned

    # mesh names no other test uses: the table is process-wide, and other tests' decisions
    # keep their specs alive
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["interned_x", "interned_y"])
    a = dist.DistSpec([4, 6], mesh, [dist.Shard(0), dist.Replicate()])
    b = dist.DistSpec([4, 6], mesh, [dist.Shard(0), dist.Replicate()])
    c = dist.DistSpec([4, 6], mesh, [dist.Shard(1), dist.Replicate()])
    other_names = dist.DistSpec(
        [4, 6], dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["interned_p", "interned_q"]), a.placements
    )
    assert a is not b and a == b
    kept = interned(a)
    assert interned(b) is kept is a
    assert interned(c) is c
    assert interned(other_names) is other_names  # the mesh's names are part of the value


def test_interned_specs_are_held_weakly() -> None:
    import gc
    import weakref

    from mpipar.spec import interned

    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["weak_x", "weak_y"])  # (no other test's)

    def kept_once() -> weakref.ref[dist.DistSpec]:
        spec = dist.DistSpec([4, 6], mesh, [dist.Shard(0), dist.Replicate()])
        return weakref.ref(interned(spec))

    first = kept_once()
    gc.collect()
    assert first() is None  # let go with its last holder
    again = dist.DistSpec([4, 6], mesh, [dist.Shard(0), dist.Replicate()])
    same = interned(again) is again
    assert same
