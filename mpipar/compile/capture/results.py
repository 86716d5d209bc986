"""Where a captured program puts its results back: the tensors it returns, the parameters, gradients
and optimizer states it leaves behind, as eager leaves them."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from mpipar.compile.capture.instructions import Array
from mpipar.tensor import Tensor

Where = tuple[tuple[Any, int], ...]
"""A tensor's arrays as (hosted rank, slot) pairs; the rank is None for a dense tensor's value."""


class TensorOut(NamedTuple):
    """A tensor the step returns, built from the slots on every run. Containers of returned
    tensors are ``(list | tuple | dict, items)`` around these (dict items as (key, template))."""

    spec: Any
    dtype: Any
    shape: Any
    where: Where


class TensorResult(NamedTuple):
    """A tensor from outside the step whose arrays the step replaced: put back as eager leaves it."""

    tensor: Any
    spec: Any
    dtype: Any
    where: Where


class GradLayout(NamedTuple):
    spec: Any
    dtype: Any
    stop_gradient: bool
    where: Where


class GradResult(NamedTuple):
    """The gradient a parameter holds after the step (None: cleared)."""

    leaf: Any
    grad: GradLayout | None


class StateResult(NamedTuple):
    """An optimizer state of one parameter after the step."""

    optimizer: Any
    param_id: int
    name: str
    spec: Any
    dtype: Any
    where: Where


Result = TensorResult | GradResult | StateResult


def template_slots(t: Any) -> list[int]:
    """The slots an output template reads."""
    if t is None:
        return []
    if isinstance(t, TensorOut):
        return [s for _, s in t.where]
    kind, items = t
    return [s for v in items for s in template_slots(v[1] if kind is dict else v)]


def rebind_slots(e: Result) -> list[int]:
    """The slots a result put back reads."""
    if isinstance(e, GradResult):
        return [] if e.grad is None else [s for _, s in e.grad.where]
    return [s for _, s in e.where]


def weak_rebind(entries: list[Result]) -> list[Result]:
    """The results with their objects (tensor, leaf, optimizer) held weakly: a program keeps nothing alive."""
    return [type(e)(weakref.ref(e[0]), *e[1:]) for e in entries]


def apply_rebind(entries: list[Result], slots: list[Any]) -> None:
    for e in entries:
        obj = e[0]()
        if obj is None:
            continue
        if isinstance(e, TensorResult):
            spec, dtype, where = e.spec, e.dtype, e.where
            if spec is None:
                obj._renew_storage(slots[where[0][1]])
            elif obj._spec is spec and obj._dense is None and obj._dtype == dtype and _holds(obj._shards, where, slots):
                # Updated in place (SGD): the same arrays, a new value. A new storage id, as
                # ``_set_dist`` gives (reshards of the old value are not reused), and read-only again.
                obj._renew_storage()
                for _, s in where:
                    slots[s].setflags(False)
            else:
                obj._set_dist(spec, {r: slots[s] for r, s in where}, dtype)
        elif isinstance(e, GradResult):
            if e.grad is None:
                if obj.grad is not None:
                    obj.grad = None
            else:
                spec, dtype, stop, where = e.grad
                obj.grad = _tensor(spec, dtype, tuple(spec.shape) if spec is not None else None, where, slots)
                obj.grad.stop_gradient = stop
        else:
            obj._states[e.param_id][e.name] = _tensor(e.spec, e.dtype, None, e.where, slots, computed=False)


def _holds(shards: dict[int, Array], where: Sequence[tuple[Any, int]], slots: list[Any]) -> bool:
    """Does ``shards`` hold exactly the slots' arrays (by identity), NumPy ones, rank for rank?"""
    if len(shards) != len(where):
        return False
    for r, s in where:
        a = slots[s]
        if shards.get(r) is not a or type(a) is not np.ndarray:
            return False
    return True


def _tensor(
    spec: Any, dtype: Any, shape: Any, where: Sequence[tuple[int | None, int]], slots: list[Any], computed: bool = True
) -> Tensor:
    if spec is None:
        return Tensor._dense_output(slots[where[0][1]], frozen=False)
    t = Tensor._from_shards(spec, {r: slots[s] for r, s in where}, dtype)
    if computed:
        t._mark_computed()  # a computed value, as the eager one (reshard it once)
    return t


def build(template: Any, slots: list[Any]) -> Any:
    """The step's return value from its output template and the run's slots."""
    if template is None:
        return None
    if isinstance(template, TensorOut):
        return _tensor(template.spec, template.dtype, template.shape, template.where, slots)
    kind, items = template
    if kind is dict:
        return {k: build(v, slots) for k, v in items}
    built = [build(v, slots) for v in items]
    return built if kind is list else tuple(built)
