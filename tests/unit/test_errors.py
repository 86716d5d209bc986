"""Bad input is refused with a ValueError/TypeError naming the object and the value at fault."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist


@pytest.fixture
def mesh() -> dist.ProcessMesh:
    return dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])


def test_placements_length_differs_from_mesh(mesh: dist.ProcessMesh) -> None:
    with pytest.raises(
        ValueError,
        match=r"shard_tensor of an array of shape \[4, 3\]: 1 placements S\(0\) given for mesh .* with 2 axes \['x', 'y'\]",
    ):
        dist.shard_tensor(np.zeros((4, 3)), mesh, [dist.Shard(0)])


def test_shard_of_missing_dim(mesh: dist.ProcessMesh) -> None:
    w = dist.Parameter(np.zeros((4, 3)), name="w0")
    with pytest.raises(
        ValueError, match=r"Tensor 'w0' of shape \[4, 3\].*Shard\(2\) on mesh axis 1 \('y'\) names tensor dim 2"
    ):
        dist.shard_tensor(w, mesh, [dist.Replicate(), dist.Shard(2)])
    x = dist.shard_tensor(np.zeros((4, 3)), mesh, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(ValueError, match=r"reshard of DistTensor of shape \[4, 3\].*Shard\(5\)"):
        dist.reshard(x, mesh, [dist.Shard(5), dist.Replicate()])


def test_duplicate_process_ids() -> None:
    with pytest.raises(ValueError, match=r"names process id\(s\) \[1\] more than once"):
        dist.ProcessMesh([[0, 1], [1, 2]])


def test_unknown_reduce_type() -> None:
    with pytest.raises(ValueError, match="reduce_type must be one of sum, avg, max, min, got 'mean'"):
        dist.Partial("mean")


def test_shape_disagrees_with_data(mesh: dist.ProcessMesh) -> None:
    shards = {r: np.zeros((2, 3)) for r in range(4)}
    shards[3] = np.zeros((1, 3))
    with pytest.raises(
        ValueError,
        match=r"the shard of rank 3 has shape \[1, 3\], but global shape \[4, 3\].*gives rank 3 a shard of shape \[2, 3\]",
    ):
        dist.dtensor_from_local(shards, mesh, [dist.Shard(0), dist.Replicate()], shape=[4, 3])


def test_non_placement_and_non_mesh(mesh: dist.ProcessMesh) -> None:
    with pytest.raises(TypeError, match=r"placements\[0\] is 0; use dist.Shard"):
        dist.shard_tensor(np.zeros(4), mesh, [0, dist.Replicate()])
    with pytest.raises(TypeError, match=r"mesh must be a dist\.ProcessMesh, got list"):
        dist.shard_tensor(np.zeros(4), [0, 1], [dist.Replicate()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a rectangular numeric array"):
        dist.shard_tensor([[1, 2], [3]], mesh, [dist.Replicate(), dist.Replicate()])


def test_local_tensor_of_unhosted_rank(mesh: dist.ProcessMesh) -> None:
    x = dist.shard_tensor(np.zeros(4), mesh, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(ValueError, match=r"rank 7 holds no shard .* hosted ranks here: \[0, 1, 2, 3\]"):
        x.local_tensor(7)
    with pytest.raises(ValueError, match="pass the rank"):
        x.local_tensor()


def test_marking_cannot_change_dtype(mesh: dist.ProcessMesh) -> None:
    with pytest.raises(ValueError, match="cannot change its dtype float64 to float32"):
        dist.shard_tensor(dist.to_tensor(np.zeros(4)), mesh, [dist.Shard(0), dist.Replicate()], dtype=np.float32)


def test_reshard_cannot_change_shape(mesh: dist.ProcessMesh) -> None:
    src = dist.DistSpec([4], mesh, [dist.Shard(0), dist.Replicate()])
    with pytest.raises(ValueError, match="cannot change the shape"):
        dist.plan_reshard(src, dist.DistSpec([5], mesh, [dist.Shard(0), dist.Replicate()]))
