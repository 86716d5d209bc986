"""Shared homes behave as the code they replaced: reshard_to, without_partial, the shared
plan helpers, one format-error class, the methods installed from above ``tensor.py``."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist
from mpipar import _tape
from mpipar.compile.plan import Plan, PlanFormatError, PlanMesh, itemsize, process_mesh
from mpipar.debug.timeline import TimelineFormatError
from mpipar.distribute import reshard_to
from mpipar.untrusted import FileFormatError
from simulator import SimBackend


def test_reshard_to_a_spec_gives_what_reshard_gives_with_the_same_communication() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    value = np.arange(48.0).reshape(6, 8)
    x = dist.shard_tensor(value, mesh, [dist.Shard(0), dist.Shard(1)])
    target = dist.DistSpec([6, 8], mesh, [dist.Replicate(), dist.Shard(0)])
    with dist.CommDebugMode() as via_public:
        a = dist.reshard(x, mesh, [dist.Replicate(), dist.Shard(0)])
    with dist.CommDebugMode() as via_spec:  # x is a leaf: no earlier reshard of it is reused
        b = reshard_to(x, target)
    assert a.spec == b.spec == target
    assert via_public.counts() == via_spec.counts() and via_spec.counts()
    np.testing.assert_array_equal(a.full_tensor(), value)
    np.testing.assert_array_equal(b.full_tensor(), value)
    for r in a.hosted_ranks:
        np.testing.assert_array_equal(a.local_tensor(r), b.local_tensor(r))


def test_public_reshard_still_names_the_tensor_in_its_errors() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(np.ones((3, 4)), mesh, [dist.Shard(0)])
    with pytest.raises(ValueError, match=r"reshard of DistTensor of shape \[3, 4\]"):
        dist.reshard(x, mesh, [dist.Shard(2)])


def test_without_partial_reads_every_partial_as_replicate_and_keeps_the_rest() -> None:
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
    spec = dist.DistSpec([4, 6], mesh, [dist.Partial(), dist.Shard(1)])
    assert spec.without_partial() == dist.DistSpec([4, 6], mesh, [dist.Replicate(), dist.Shard(1)])
    plain = dist.DistSpec([4, 6], mesh, [dist.Shard(0), dist.Replicate()])
    assert plain.without_partial() is plain


def test_plan_helpers_size_dtypes_and_rebuild_meshes_beyond_the_world() -> None:
    assert [itemsize(d) for d in ("bfloat16", "float8_e5m2", "float32", "int64", "complex128")] == [2, 1, 4, 8, 16]
    assert itemsize("not-a-dtype") == 4
    with dist.use_backend(_fixed_world(4)):
        mesh = process_mesh(PlanMesh(0, (2, 512), tuple(range(1024)), ("dp", "tp")))
    assert mesh.shape == [2, 512] and mesh.dim_names == ["dp", "tp"] and mesh.process_ids[-1] == 1023


def _fixed_world(n: int) -> SimBackend:
    return SimBackend(n)


def test_plan_and_timeline_format_errors_are_one_class() -> None:
    assert PlanFormatError is TimelineFormatError is FileFormatError
    with pytest.raises(PlanFormatError, match=r"plan field format: 'x'"):
        Plan.from_dict({"format": "x"})


def test_methods_installed_from_above_tensor_py_work() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    w = dist.shard_tensor(dist.Parameter(np.array([1.0, 2.0, 3.0, 4.0])), mesh, [dist.Shard(0)])
    dist.sum(dist.multiply(w, w)).backward()  # Tensor.backward, installed by mpipar.autograd
    np.testing.assert_array_equal(w.grad.full_tensor(), [2.0, 4.0, 6.0, 8.0])
    assert w.placement is not None and w.placement.mesh == mesh  # installed by mpipar.oneflow
    assert dist.Tensor(np.ones(2)).placement is None
    assert mesh.get_submesh_with_dim("x") == mesh  # installed by mpipar.backend
    with _tape.no_grad():
        assert not dist.is_grad_enabled()


def test_reshard_to_refuses_a_spec_of_another_shape() -> None:
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor(np.ones((4, 2)), mesh, [dist.Shard(0)])
    with pytest.raises(ValueError, match=r"reshard of DistTensor of shape \[4, 2\] to \[4, 3\]@.*another global shape"):
        reshard_to(x, dist.DistSpec([4, 3], mesh, [dist.Replicate()]))
