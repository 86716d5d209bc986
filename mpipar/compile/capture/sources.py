"""Where a captured program reads the arrays it does not make: the step's arguments, tensors
from outside the step, gradients and optimizer states, each read live on every run."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mpipar.compile.capture.instructions import Array, Stale


class ArgSource(NamedTuple):
    """The step's argument at ``position``: its shard of ``rank`` (None: its dense value), or the
    argument itself when ``rank`` is ``"array"`` (an array handed to ``shard_tensor``)."""

    position: int
    rank: int | str | None


class TensorSource(NamedTuple):
    """A tensor from outside the step (a parameter, a buffer): its shard of ``rank``."""

    tensor: Any
    rank: int | None


class GradSource(NamedTuple):
    """The gradient a parameter holds (``leaf.grad``): its shard of ``rank``."""

    leaf: Any
    rank: int | None


class StateSource(NamedTuple):
    """An optimizer's state ``name`` of the parameter ``param_id``: its shard of ``rank``."""

    optimizer: Any
    param_id: int
    name: str
    rank: int | None


Source = ArgSource | TensorSource | GradSource | StateSource


def source_key(src: Source) -> tuple[Any, ...]:
    """A source as a comparable key (objects by identity, kept alive by the trace)."""
    if isinstance(src, ArgSource):
        return (ArgSource, src.position, src.rank)
    if isinstance(src, TensorSource):
        return tensor_key(src.tensor, src.rank)
    if isinstance(src, GradSource):
        return (GradSource, id(src.leaf), src.rank)
    return (StateSource, id(src.optimizer), src.param_id, src.name, src.rank)


def tensor_key(t: Any, rank: int | None) -> tuple[Any, ...]:
    """``source_key`` of ``TensorSource(t, rank)``."""
    return (TensorSource, id(t), rank)


def describe(src: Source) -> str:
    """A source in words, for a refusal's reason."""
    if isinstance(src, ArgSource):
        return f"argument {src.position}"
    if isinstance(src, TensorSource):
        return src.tensor._label()
    if isinstance(src, GradSource):
        return f"the gradient of {src.leaf._label()}"
    return f"optimizer state {src.name} of parameter {src.param_id}"


def layout_of(array: Array) -> tuple[Any, ...]:
    """What the signature keeps of a root array: its shape and dtype (its values are the call's)."""
    return (tuple(getattr(array, "shape", ())), str(getattr(array, "dtype", "")))


def arrays_of(t: Any) -> list[tuple[int | None, Array]]:
    """A tensor's arrays by hosted rank (None: the whole value of a dense tensor); a distributed
    tensor this process hosts no rank of has none."""
    if t._spec is not None:
        return list(t._shards.items())
    return [(None, t._value)]


def grad_state(leaf: Any) -> Any:
    """What a program checks of a parameter before it runs: trainable or not, gradient layout."""
    g = leaf.grad
    return (leaf.stop_gradient, None if g is None else (g._spec, g._dtype))


def _read(t: Any, r: Any) -> Array:
    """``t``'s shard of rank ``r`` (None: its dense value) now; ``Stale`` when it has none."""
    if r is None:
        v = t._dense
        if v is None or t._init is not None:
            raise Stale
        return v
    a = t._shards.get(r)
    if a is None:
        raise Stale
    return a


def getter(src: Source) -> Callable[[Sequence[Any]], Array]:
    """A function of the call's flat arguments reading the source's array live."""
    if isinstance(src, ArgSource):
        i, r = src.position, src.rank

        def arg(flat: Sequence[Any]) -> Array:
            a = flat[i]
            return a if r == "array" else _read(a, r)

        return arg
    if isinstance(src, TensorSource):
        ref = weakref.ref(src.tensor)
        rank = src.rank

        def tensor(flat: Sequence[Any]) -> Array:
            t = ref()
            if t is None:
                raise Stale
            return _read(t, rank)

        return tensor
    if isinstance(src, GradSource):
        leaf_ref = weakref.ref(src.leaf)
        rank = src.rank

        def grad(flat: Sequence[Any]) -> Array:
            t = leaf_ref()
            if t is None or t.grad is None:
                raise Stale
            return _read(t.grad, rank)

        return grad
    opt_ref, pid, name, rank = weakref.ref(src.optimizer), src.param_id, src.name, src.rank

    def state(flat: Sequence[Any]) -> Array:
        opt = opt_ref()
        st = opt._states.get(pid) if opt is not None else None
        if st is None or name not in st:
            raise Stale
        return _read(st[name], rank)

    return state
