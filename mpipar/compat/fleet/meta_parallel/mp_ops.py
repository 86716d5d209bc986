"""The differentiable collectives of Megatron-style tensor parallelism, on per-rank tensors.

Each is a forward collective paired with the backward that keeps gradients exact when the
loss is replicated over the model-parallel group (every member computes the same loss, and
the gradient of a replicated tensor is the same on every member):

================  ===============================  ===================================
function          forward                          backward
================  ===============================  ===================================
``c_identity``    identity                         all_reduce sum of the gradient
``mp_allreduce``  all_reduce sum                   identity
``c_split``       this member's slice of the last  all_gather of the slices' gradients
                  dim
``c_concat``      all_gather along the last dim    this member's slice of the gradient
================  ===============================  ===================================

``c_identity`` and ``mp_allreduce`` are ``mpipar.collective``'s (manual mode); the split and
concat pair is added here. ``group=None`` is the world, as for every manual collective; a
group of one member makes all four the identity.
"""

from __future__ import annotations

import numpy as np

from mpipar.backend import current_backend
from mpipar.compat.collective import Group, _link, _read, _transport, c_identity, mp_allreduce
from mpipar.compat.collective import _members as _group_members
from mpipar.tensor import Tensor


def _members(group: Group | None, call: str) -> tuple[int, ...]:
    """The group's ranks (the world for None, as every manual collective takes it)."""
    members = _group_members(group, call)
    if members is None:
        raise ValueError(f"{call}: rank {current_backend().rank} is not a member of {group}")
    return members


def _pieces(value: np.ndarray, n: int, what: str) -> list[np.ndarray]:
    if value.ndim == 0 or value.shape[-1] % n:
        raise ValueError(
            f"{what}: the last dim of {value.dtype}{list(value.shape)} does not split into {n} equal parts "
            "over the model-parallel group; make it a multiple of mp_degree"
        )
    return np.split(value, n, axis=-1)


def _gather_last(value: np.ndarray, members: tuple[int, ...], call: str) -> np.ndarray:
    if len(members) == 1:
        return value
    pieces = _transport(call).all_gather(members, np.ascontiguousarray(value))
    return np.concatenate([np.asarray(p) for p in pieces], axis=-1)


def _slice_last(value: np.ndarray, members: tuple[int, ...], what: str) -> np.ndarray:
    if len(members) == 1:
        return value
    return np.ascontiguousarray(_pieces(value, len(members), what)[members.index(current_backend().rank)])


def c_split(x: Tensor, group: Group | None = None) -> Tensor:
    """Forward: this member's slice of the last dim; backward: all_gather of the slices' gradients."""
    members = _members(group, "c_split")
    value = _slice_last(_read(x, "c_split input"), members, "c_split")
    out = Tensor(value, dtype=value.dtype)

    def grad(g: Tensor | None) -> Tensor | None:
        if g is None:
            return None
        whole = _gather_last(_read(g, "c_split gradient"), members, "c_split backward")
        return Tensor(whole, dtype=whole.dtype)

    return _link(out, x, "c_split", grad)


def c_concat(x: Tensor, group: Group | None = None) -> Tensor:
    """Forward: all_gather along the last dim (members' slices in group order); backward: this member's slice."""
    members = _members(group, "c_concat")
    value = _gather_last(_read(x, "c_concat input"), members, "c_concat")
    out = Tensor(value, dtype=value.dtype)

    def grad(g: Tensor | None) -> Tensor | None:
        if g is None:
            return None
        mine = _slice_last(_read(g, "c_concat gradient"), members, "c_concat backward")
        return Tensor(mine, dtype=mine.dtype)

    return _link(out, x, "c_concat", grad)


__all__ = ["c_concat", "c_identity", "c_split", "mp_allreduce"]
