"""OneFlow's global-tensor spelling of mpipar's distributed tensors (seed 002).

One semantics, two spellings: a OneFlow ``placement`` is a :class:`ProcessMesh`, an SBP is a
placement (``sbp.split(axis)`` is ``Shard(axis)``, ``sbp.broadcast`` is ``Replicate()``,
``sbp.partial_sum`` is ``Partial("sum")``), and ``tensor.to_global(placement, sbp)`` is
``shard_tensor`` (dense input) or ``reshard`` (global input). Nothing here keeps state of its own,
so a program may mix both spellings on the same tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar.backend import current_backend
from mpipar.distribute import reshard, shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.nn.functional import gelu, relu
from mpipar.nn.layer import get_default_dtype
from mpipar.ops.linalg import matmul
from mpipar.optimizer import SGD as _SGD
from mpipar.optimizer import Adam as _Adam
from mpipar.optimizer import AdamW as _AdamW
from mpipar.optimizer import Optimizer
from mpipar.placement import Partial, Placement, Replicate, Shard
from mpipar.spec import box_shape
from mpipar.tensor import Tensor

__all__ = [
    "gelu",
    "manual_seed",
    "matmul",
    "ones",
    "optim",
    "placement",
    "randn",
    "relu",
    "sbp",
    "tensor",
    "to_global",
    "to_local",
    "zeros",
]

_DEVICE_TYPES = ("cpu", "cuda")


class placement:
    """``flow.placement(type, ranks)``: the devices a global tensor lives on, as a mesh.

    ``ranks`` is a 1-d list (a 1-d mesh) or a 2-d nested list (a 2-d mesh, rows first), as in
    OneFlow. ``type`` is ``"cpu"`` or ``"cuda"``; mpipar picks the device per backend, so the
    type is recorded and checked but does not change where values live.
    """

    def __init__(self, type: str = "cpu", ranks: Any = None) -> None:
        if not isinstance(type, str) or type not in _DEVICE_TYPES:
            raise ValueError(f"placement: type={type!r} is not a device type; use one of {list(_DEVICE_TYPES)}")
        if ranks is None:
            raise TypeError("placement: ranks is missing; pass a list of ranks such as ranks=[0, 1]")
        ids = np.asarray(ranks, dtype=object)
        if ids.ndim not in (1, 2) or ids.size == 0:
            raise ValueError(
                f"placement: ranks={ranks!r} must be a non-empty 1-d list or a rectangular 2-d nested list of ranks"
            )
        names = ["x"] if ids.ndim == 1 else ["x", "y"]
        try:
            self._mesh = ProcessMesh(ranks, dim_names=names)
        except (TypeError, ValueError) as err:
            raise ValueError(f"placement: ranks={ranks!r} is not a valid rank list: {err}") from None
        self._type = type

    @classmethod
    def from_mesh(cls, mesh: ProcessMesh, type: str | None = None) -> placement:
        """The placement naming the same ranks as ``mesh`` (keeping its axis names); ``type``
        defaults to where this backend keeps values (``cuda`` on NCCL, ``cpu`` otherwise)."""
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"placement.from_mesh: mesh must be a ProcessMesh, got {mesh!r}")
        if type is None:
            type = "cuda" if current_backend().name == "nccl" else "cpu"
        elif type not in _DEVICE_TYPES:
            raise ValueError(
                f"placement.from_mesh: type={type!r} is not a device type; use one of {list(_DEVICE_TYPES)}"
            )
        out = cls.__new__(cls)
        out._mesh = mesh
        out._type = type
        return out

    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> list[Any]:
        """The rank list as given (nested for a 2-d placement)."""
        return self._mesh.mesh.tolist()

    @property
    def hierarchy(self) -> list[int]:
        return list(self._mesh.shape)

    @property
    def mesh(self) -> ProcessMesh:
        """The mpipar mesh this placement spells."""
        return self._mesh

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, placement):
            return NotImplemented
        return (
            self._type == other._type
            and self._mesh.shape == other._mesh.shape
            and (self._mesh.process_ids == other._mesh.process_ids)
        )

    def __hash__(self) -> int:
        return hash((self._type, tuple(self._mesh.shape), tuple(self._mesh.process_ids)))

    def __repr__(self) -> str:
        return f"oneflow.placement(type={self._type!r}, ranks={self.ranks})"


# to_global's parameter is named ``placement`` (OneFlow's keyword), shadowing the class there
_PlacementClass = placement


class _SbpNamespace:
    """``flow.sbp``: ``split(axis)``, ``broadcast``, ``partial_sum`` as mpipar placements."""

    broadcast: Placement = Replicate()
    partial_sum: Placement = Partial("sum")

    @staticmethod
    def split(axis: int | None = None, *, dim: int | None = None) -> Placement:
        """``sbp.split(axis)``; OneFlow also spells it ``sbp.split(dim=axis)`` (seed 002 does)."""
        if (axis is None) == (dim is None):
            raise TypeError(
                f"sbp.split: give the tensor axis once, as split(axis) or split(dim=axis); got axis={axis!r}, dim={dim!r}"
            )
        axis = axis if axis is not None else dim
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or axis < 0:
            raise ValueError(f"sbp.split: axis={axis!r} must be a non-negative int (the tensor axis to split)")
        return Shard(int(axis))


sbp = _SbpNamespace()


def _sbp_list(value: Any, where: placement, shape: Sequence[int]) -> list[Placement]:
    sbps = list(value) if isinstance(value, (list, tuple)) else [value]
    for s in sbps:
        if not isinstance(s, Placement):
            raise TypeError(
                f"to_global: sbp entry {s!r} is not an SBP; use flow.sbp.split(axis), flow.sbp.broadcast "
                "or flow.sbp.partial_sum"
            )
    if len(sbps) != where.mesh.ndim:
        raise ValueError(
            f"to_global: sbp={sbps} has {len(sbps)} entries but {where!r} is {where.mesh.ndim}-d; "
            "give one SBP per placement dimension"
        )
    for s in sbps:
        if isinstance(s, Shard) and s.dim >= len(shape):
            raise ValueError(
                f"to_global: sbp.split({s.dim}) names axis {s.dim} of a tensor of shape {list(shape)}; "
                f"split an axis below {len(shape)}"
            )
    return sbps


def to_global(tensor: Any, placement: placement, sbp: Any) -> Tensor:
    """``tensor.to_global(placement, sbp)``: a global (distributed) tensor.

    A local (dense) tensor or array is taken as the global value every rank holds and is
    distributed as ``sbp`` says; a global tensor is redistributed (communication as a reshard).
    """
    if not isinstance(placement, _PlacementClass):
        raise TypeError(f"to_global: placement must be flow.placement(type, ranks), got {placement!r}")
    src = tensor if isinstance(tensor, Tensor) else Tensor(np.asarray(tensor))
    sbps = _sbp_list(sbp, placement, src.shape)
    if src.is_dist:
        return reshard(src, placement.mesh, sbps)
    return shard_tensor(src, placement.mesh, sbps)


def to_local(tensor: Tensor) -> Any:
    """``tensor.to_local()``: this rank's shard of a global tensor (a local tensor stays as is)."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"to_local: expected a mpipar Tensor, got {type(tensor).__name__}")
    if not tensor.is_dist:
        return tensor
    return Tensor(tensor.local_tensor())


# ------------------------------------------------------------------------------ factories
# OneFlow's factories take ``placement=``/``sbp=`` to build a global tensor directly. Values come
# from mpipar's counter-based generator, a pure function of (seed, draw, global index): each rank
# generates only its own shard and the global value is the one a single device draws.


def _shape_of(size: tuple[Any, ...], where: str) -> tuple[int, ...]:
    dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (list, tuple)) else size
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"{where}: size {list(dims)} has {d!r}; every dimension must be a non-negative int")
    return tuple(int(d) for d in dims)


def _dtype_of(dtype: Any) -> np.dtype[Any]:
    """OneFlow's default is float32; mpipar's default dtype (``nn.set_default_dtype``) rules here
    so that the OneFlow spelling and the rest of a program agree."""
    return np.dtype(get_default_dtype() if dtype is None else dtype)


def _finish(value: Tensor, placement: Any, sbp: Any, requires_grad: bool, where: str) -> Tensor:
    if (placement is None) != (sbp is None):
        raise ValueError(
            f"{where}: give placement and sbp together (a global tensor) or neither (a local one); "
            f"got placement={placement!r}, sbp={sbp!r}"
        )
    out = value if placement is None else to_global(value, placement, sbp)
    out.stop_gradient = not requires_grad
    return out


def randn(*size: Any, dtype: Any = None, placement: Any = None, sbp: Any = None, requires_grad: bool = False) -> Tensor:
    """``flow.randn(*size, placement=, sbp=)``: standard normal values, local or global."""
    shape, dt = _shape_of(size, "randn"), _dtype_of(dtype)
    key = mrandom.next_key()
    value = Tensor.lazy(shape, dt, lambda shp, box: mrandom.normal_box(key, shp, box).astype(dt))
    return _finish(value, placement, sbp, requires_grad, "randn")


def zeros(*size: Any, dtype: Any = None, placement: Any = None, sbp: Any = None, requires_grad: bool = False) -> Tensor:
    shape, dt = _shape_of(size, "zeros"), _dtype_of(dtype)
    value = Tensor.lazy(shape, dt, lambda shp, box: np.zeros(box_shape(box), dtype=dt))
    return _finish(value, placement, sbp, requires_grad, "zeros")


def ones(*size: Any, dtype: Any = None, placement: Any = None, sbp: Any = None, requires_grad: bool = False) -> Tensor:
    shape, dt = _shape_of(size, "ones"), _dtype_of(dtype)
    value = Tensor.lazy(shape, dt, lambda shp, box: np.ones(box_shape(box), dtype=dt))
    return _finish(value, placement, sbp, requires_grad, "ones")


def tensor(data: Any, dtype: Any = None, placement: Any = None, sbp: Any = None, requires_grad: bool = False) -> Tensor:
    """``flow.tensor(data, placement=, sbp=)``: ``data`` is the global value every rank holds."""
    try:
        array = np.asarray(data, dtype=None if dtype is None else np.dtype(dtype))
    except (TypeError, ValueError) as err:
        raise ValueError(f"tensor: data is not a numeric array: {err}") from None
    if array.dtype.kind not in "biuf":
        raise ValueError(f"tensor: data has dtype {array.dtype}; give numbers")
    return _finish(Tensor(array), placement, sbp, requires_grad, "tensor")


def manual_seed(seed: int) -> None:
    """``flow.manual_seed``: every rank must call it with the same seed (as in OneFlow)."""
    mrandom.seed(seed)


class _OptimNamespace:
    """``flow.optim``: OneFlow's (PyTorch's) optimizer spelling over mpipar's optimizers."""

    @staticmethod
    def SGD(params: Any, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0) -> Optimizer:
        if momentum:
            raise ValueError(f"optim.SGD: momentum={momentum!r} is not supported here; use mpipar.optimizer.Momentum")
        return _SGD(learning_rate=lr, parameters=list(params), weight_decay=weight_decay or None)

    @staticmethod
    def Adam(params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> Optimizer:
        return _Adam(learning_rate=lr, beta1=betas[0], beta2=betas[1], epsilon=eps, parameters=list(params))

    @staticmethod
    def AdamW(
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> Optimizer:
        return _AdamW(
            learning_rate=lr,
            beta1=betas[0],
            beta2=betas[1],
            epsilon=eps,
            weight_decay=weight_decay,
            parameters=list(params),
        )


optim = _OptimNamespace()


def _tensor_placement(self: Tensor) -> Any:
    """OneFlow's ``tensor.placement`` (``None`` for a local tensor)."""
    return placement.from_mesh(self._spec.mesh) if self._spec is not None else None


# Installed from here, as mpipar.ops.tensor_methods installs the operators: the OneFlow spelling
# builds on ``tensor.py``, which does not know it.
Tensor.placement = property(_tensor_placement)  # type: ignore[attr-defined]
Tensor.to_global = to_global  # type: ignore[attr-defined]
Tensor.to_local = to_local  # type: ignore[attr-defined]
