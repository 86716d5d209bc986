"""The three execution modes decided in one place (``mpipar._modes``)."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist
from mpipar._modes import Mode, execution_mode
from mpipar.backend import Backend
from simulator import ReferenceBackend, ShapeOnlyBackend, SimBackend


@pytest.mark.parametrize(
    ("backend", "mode"),
    [(SimBackend(), Mode.DISTRIBUTED), (ReferenceBackend(), Mode.DENSE), (ShapeOnlyBackend(), Mode.ABSTRACT)],
)
def test_the_backend_decides_without_abstract_tensors(backend: Backend, mode: Mode) -> None:
    real = dist.Tensor(np.ones(3))
    assert execution_mode((), backend) is mode
    assert execution_mode([real], backend) is mode
    with dist.use_backend(backend):
        assert execution_mode() is mode  # the current backend by default


@pytest.mark.parametrize("backend", [SimBackend(), ReferenceBackend(), ShapeOnlyBackend()])
def test_an_abstract_tensor_makes_any_backend_abstract(backend: Backend) -> None:
    ghost = dist.Tensor.abstract((2, 3), np.float32)
    assert execution_mode([dist.Tensor(np.ones(3)), ghost], backend) is Mode.ABSTRACT


def test_op_dispatch_follows_the_mode() -> None:
    """The same matmul under each mode: shards, one device's whole value, or shapes only."""
    a = np.arange(12.0).reshape(3, 4)
    b = np.arange(8.0).reshape(4, 2)
    mesh = dist.ProcessMesh([0, 1], ["x"])
    with dist.use_backend(SimBackend()):
        y = dist.matmul(dist.shard_tensor(a, mesh, [dist.Shard(0)]), dist.to_tensor(b))
        assert sorted(y._shards) == [0, 1] and not y.is_abstract
        np.testing.assert_array_equal(y.numpy(), a @ b)
        ghost = dist.matmul(dist.Tensor.abstract((3, 4), np.float64), dist.to_tensor(b))
        assert ghost.is_abstract and list(ghost.shape) == [3, 2]
    with dist.use_backend(ReferenceBackend()):
        y = dist.matmul(dist.shard_tensor(a, mesh, [dist.Shard(0)]), dist.to_tensor(b))
        assert y._shards == {} and y._value is not None
        np.testing.assert_array_equal(y.numpy(), a @ b)
    with dist.use_backend(ShapeOnlyBackend()):
        y = dist.matmul(dist.shard_tensor(a, mesh, [dist.Shard(0)]), dist.to_tensor(b))
        assert y.is_abstract and list(y.shape) == [3, 2] and y.placements == [dist.Shard(0)]
