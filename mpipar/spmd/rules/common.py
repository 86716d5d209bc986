"""Helpers shared by rule builders: broadcasting letters, axis normalisation."""

from __future__ import annotations

import string
from collections.abc import Sequence

from mpipar.spec import DistSpec

LOWER = string.ascii_lowercase
UPPER = string.ascii_uppercase


def norm_axis(axis: int, ndim: int, op: str, what: str = "axis") -> int:
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"{op}: {what} {axis} is out of range for a tensor with {ndim} dims")
    return axis % ndim if ndim else 0


def norm_axes(axis: int | Sequence[int] | None, ndim: int, op: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        if type(axis) is int and 0 <= axis < ndim:  # already normal (most calls): one dim, nothing to sort
            return (axis,)
        axis = [axis]
    elif type(axis) is tuple and len(axis) == 1 and type(a := axis[0]) is int and 0 <= a < ndim:
        return axis  # one normal dim in a tuple (a bias gradient's batch sum)
    out = sorted({norm_axis(int(a), ndim, op) for a in axis})
    return tuple(out)


def broadcast_shape(shapes: Sequence[Sequence[int]], op: str, specs: Sequence[DistSpec] | None = None) -> list[int]:
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for j, n in enumerate(shape):
            k = ndim - len(shape) + j
            if out[k] == 1:
                out[k] = n
            elif n not in (1, out[k]):
                who = ", ".join(str(s) for s in specs) if specs else ", ".join(str(list(s)) for s in shapes)
                raise ValueError(f"{op}: shapes do not broadcast (dim {k}: {out[k]} vs {n}) for inputs {who}")
    return out


def broadcast_letters(specs: Sequence[DistSpec], op: str) -> tuple[tuple[str, ...], str, frozenset[str]]:
    """Letters for an elementwise op with NumPy broadcasting.

    Output dims get lowercase letters; an input dim of size 1 broadcast against a larger
    one gets its own uppercase letter that must stay whole (it is repeated, not split).
    """
    out_shape = broadcast_shape([s.shape for s in specs], op, specs)
    ndim = len(out_shape)
    out_letters = LOWER[:ndim]
    fresh = iter(UPPER)
    no_shard: set[str] = set()
    ins = []
    for spec in specs:
        letters = []
        for j, n in enumerate(spec.shape):
            k = ndim - len(spec.shape) + j
            if n == out_shape[k]:
                letters.append(out_letters[k])
            else:
                letter = next(fresh)
                no_shard.add(letter)
                letters.append(letter)
        ins.append("".join(letters))
    return tuple(ins), out_letters, frozenset(no_shard)
