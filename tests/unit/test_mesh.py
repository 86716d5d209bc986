"""ProcessMesh: shapes, names, coordinates, rank groups, sub-meshes, value semantics, errors."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist


def test_seed_mesh_basics() -> None:
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    assert mesh.shape == [2, 3]
    assert mesh.ndim == 2
    assert mesh.process_ids == [2, 4, 5, 0, 1, 3]
    assert mesh.dim_names == ["x", "y"]
    assert mesh.coordinate(1) == (1, 1)
    assert mesh.rank_group("y", 1) == (0, 1, 3)
    assert mesh.rank_group(0, 5) == (5, 3)
    assert mesh.get_dim_size("y") == 3
    assert 3 in mesh and 7 not in mesh


def test_default_names_and_equality() -> None:
    a = dist.ProcessMesh([0, 1, 2, 3])
    assert a.dim_names == ["d0"]
    assert a == dist.ProcessMesh(np.arange(4))
    assert a != dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    assert a != dist.ProcessMesh([[0, 1], [2, 3]])
    assert len({a, dist.ProcessMesh([0, 1, 2, 3])}) == 1


def test_sub_meshes() -> None:
    mesh = dist.ProcessMesh([[0, 1, 2], [3, 4, 5]], dim_names=["dp", "tp"])
    assert mesh[1] == dist.ProcessMesh([3, 4, 5], dim_names=["tp"])
    assert mesh[:, 0] == dist.ProcessMesh([0, 3], dim_names=["dp"])
    assert mesh[:, 1:] == dist.ProcessMesh([[1, 2], [4, 5]], dim_names=["dp", "tp"])
    moved = mesh.get_mesh_with_dim("tp")
    assert moved.dim_names == ["tp", "dp"] and moved.shape == [3, 2]
    assert mesh.get_mesh_with_dim("tp", 2) == dist.ProcessMesh([2, 5], dim_names=["dp"])


def test_groups_partition_the_mesh() -> None:
    mesh = dist.ProcessMesh(np.arange(24).reshape(2, 3, 4))
    for axes in ([0], [1], [2], [0, 2], [1, 2], [0, 1, 2]):
        groups = mesh.groups(axes)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(24))
        size = int(np.prod([mesh.shape[a] for a in axes]))
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only on the group's axes, row-major over them
            coords = [mesh.coordinate(r) for r in g]
            others = [a for a in range(3) if a not in axes]
            assert len({tuple(c[a] for a in others) for c in coords}) == 1
            assert [tuple(c[a] for a in axes) for c in coords] == sorted(tuple(c[a] for a in axes) for c in coords)


@pytest.mark.parametrize(
    ("ids", "names", "message"),
    [
        ([0, 1, 1], None, "more than once"),
        ([[0, 1], [2]], None, "rectangular"),
        ([0, -1], None, ">= 0"),
        ([0, 1], ["x", "y"], "1 axes but 2 dim_names"),
        ([[0, 1], [2, 3]], ["x", "x"], "duplicate"),
        ([0.5, 1], None, "integers"),
    ],
)
def test_bad_meshes_are_refused(ids: object, names: list[str] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dist.ProcessMesh(ids, dim_names=names)


def test_unknown_axis_name() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    with pytest.raises(ValueError, match="no axis named 'z'"):
        mesh.rank_group("z", 0)
    with pytest.raises(ValueError, match="not in mesh"):
        mesh.coordinate(9)


def test_fixed_world_refuses_larger_mesh() -> None:
    from simulator import SimBackend

    # A mesh is a pure value: built freely, refused where it first meets the backend.
    with dist.use_backend(SimBackend(4)):
        mesh = dist.ProcessMesh([4, 5])
        with pytest.raises(ValueError, match=r"names process 4, but the world has 4 ranks.*-n 6"):
            dist.shard_tensor(np.zeros(2), mesh, [dist.Shard(0)])


def test_building_a_mesh_asks_no_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """mesh.py is pure: no backend is chosen (nor MPI started) to build, slice or compare meshes."""
    from mpipar import backend

    def refuse() -> backend.Backend:
        raise AssertionError("ProcessMesh asked for the backend")

    monkeypatch.setattr(backend, "current_backend", refuse)
    mesh = dist.ProcessMesh(np.arange(1024).reshape(32, 32), dim_names=["dp", "tp"])
    assert mesh[3].process_ids == list(range(96, 128))
    assert mesh.get_mesh_with_dim("tp", 0).process_ids == list(range(0, 1024, 32))
    assert dist.ProcessMesh.from_dict(mesh.to_dict()) == mesh


def test_every_front_door_refuses_a_mesh_beyond_the_world() -> None:
    from simulator import SimBackend

    small = dist.ProcessMesh([0, 1], ["x"])
    big = dist.ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    with dist.use_backend(SimBackend(2)):
        x = dist.shard_tensor(np.arange(4.0), small, [dist.Shard(0)])
        with pytest.raises(ValueError, match=r"names process 2, but the world has 2 ranks.*-n 4"):
            dist.reshard(x, big, [dist.Replicate(), dist.Replicate()])
        with pytest.raises(ValueError, match=r"names process 2, but the world has 2 ranks"):
            dist.dtensor_from_local(lambda r: np.zeros(1), big, [dist.Shard(0), dist.Replicate()])
        with pytest.raises(ValueError, match=r"names process 2, but the world has 2 ranks"):
            big.get_submesh_with_dim("b")


def test_the_unfixed_simulator_grows_with_the_meshes_used() -> None:
    from simulator import SimBackend

    with dist.use_backend(SimBackend()) as backend:
        mesh = dist.ProcessMesh([0, 1, 2, 3, 4, 5], ["x"])
        assert backend.world_size == 1  # built, not yet used
        dist.shard_tensor(np.arange(6.0), mesh, [dist.Shard(0)])
        assert backend.world_size == 6
