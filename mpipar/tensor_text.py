"""How a tensor prints: Paddle's text, with the value, made from what this process holds.

``str(t)`` (and so ``print(t)``) reads like Paddle's::

    Tensor(shape=[], dtype=float32, place=Place(cpu), stop_gradient=False,
           0.12345678)

and for a distributed tensor adds its mesh and placements and the value as
``GlobalDenseTensor=``. Printing never communicates: a print that only some ranks run (``if
rank == 0: print(loss)``) must not wait for the others, so the text is made from the shards
this process holds, reassembled locally (``held_value``):

========================================  =============================================
what this process holds                    what prints
========================================  =============================================
a dense tensor, or ``--reference``         the value
every rank of the mesh (the simulator)     the global value (shards joined, Partial reduced)
a replica of the whole value (MPI, a       the global value
tensor Replicate on every mesh axis)
a shard or a partial piece (MPI)           ``LocalDenseTensor(rank r)=``: this rank's piece,
                                           labelled; ``t.full_tensor()`` (a collective every
                                           rank must join) gives the global value
nothing (MPI, a rank outside the mesh)     no value, as Paddle prints for such a rank
========================================  =============================================

Paddle itself reshards to Replicate inside ``print`` (a collective over the tensor's mesh), so
its print on only one rank of a sharded tensor hangs; here it prints that rank's piece instead.
``repr(t)`` stays the short metadata form (no value), for error messages and debuggers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Any

import numpy as np

from mpipar._xp import to_numpy
from mpipar.placement import Placement
from mpipar.spec import Box, DistSpec

PRECISION = 8
"""Digits after the point, Paddle's default print precision."""

_Cell = tuple[Box, np.ndarray] | None


def held_value(spec: DistSpec, shards: Mapping[int, Any]) -> np.ndarray | None:
    """The global value of ``spec`` from the ``shards`` (rank -> local array) this process
    holds, with no communication: shards joined along Shard axes, partial pieces reduced along
    Partial axes, any replica taken along Replicate axes. None when the held shards do not
    determine it (a shard or partial piece of another rank is missing)."""
    ids = spec.mesh.mesh
    cells = np.empty(ids.shape, dtype=object)
    for index, rank in np.ndenumerate(ids):
        local = shards.get(int(rank))
        cells[index] = None if local is None else (spec.local_box(int(rank)), to_numpy(local))
    for axis in reversed(range(ids.ndim)):  # collapse the mesh one axis at a time, the last first
        along = np.moveaxis(cells, axis, -1)
        out = np.empty(along.shape[:-1], dtype=object)
        for index in np.ndindex(out.shape):
            out[index] = _combine(spec.placements[axis], list(along[index]))
        cells = out
    whole = cells[()]
    return None if whole is None else np.asarray(whole[1])


def _combine(placement: Placement, cells: Sequence[_Cell]) -> _Cell:
    """The cells of one mesh axis (the others fixed) as one: what the axis' placement says."""
    if placement.is_replicated():
        return next((c for c in cells if c is not None), None)
    if any(c is None for c in cells):
        return None
    held = [c for c in cells if c is not None]
    if placement.is_partial():
        op = getattr(placement, "reduce_type", "sum")
        values = [a for _, a in held]
        if op == "avg":
            return held[0][0], reduce(np.add, values) / len(values)
        fn = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        return held[0][0], reduce(fn, values)
    # Shard: place every piece in the box they cover together
    box = tuple((min(b[d][0] for b, _ in held), max(b[d][1] for b, _ in held)) for d in range(len(held[0][0])))
    out = np.empty([hi - lo for lo, hi in box], dtype=held[0][1].dtype)
    for b, a in held:
        out[tuple(slice(lo - blo, hi - blo) for (lo, hi), (blo, _) in zip(b, box, strict=True))] = a
    return box, out


def format_value(value: np.ndarray, indent: int) -> str:
    """The value as Paddle prints it: 8 digits after the point (integral floats as ``1.``),
    ``[a, b]`` rows, continuation lines indented under the opening parenthesis."""
    value = np.asarray(value)
    floating = value.dtype.kind in "fc"
    integral = floating and bool(np.all(np.isfinite(value) & (np.asarray(value) == np.round(value))))
    text = np.array2string(
        value,
        precision=PRECISION,
        separator=", ",
        prefix=" " * indent,
        floatmode="fixed" if floating and not integral else "maxprec",
        suppress_small=True,
        threshold=1000,
        edgeitems=3,
        max_line_width=80,
    )
    return text


def place_of(array: Any) -> str:
    """Paddle's ``Place(cpu)`` / ``Place(gpu:N)`` for an array of NumPy or CuPy."""
    device = getattr(array, "device", None)
    if type(array).__module__.split(".")[0] == "cupy" and device is not None:
        return f"Place(gpu:{int(getattr(device, 'id', 0))})"
    return "Place(cpu)"


def tensor_text(
    shape: Sequence[int],
    dtype: np.dtype,
    stop_gradient: bool,
    value: Any,
    dist: tuple[DistSpec, str] | None = None,
) -> str:
    """Paddle's print of a tensor. ``value``: the array to show (None: no value here);
    ``dist``: (spec, label) of a distributed tensor, the label naming what the value is
    (``GlobalDenseTensor`` or ``LocalDenseTensor(rank r)``, or a phrase when there is none)."""
    prefix = "Tensor"
    indent = len(prefix) + 1
    head = (
        f"{prefix}(shape={list(shape)}, dtype={np.dtype(dtype).name}, place={place_of(value)}, "
        f"stop_gradient={stop_gradient}"
    )
    if dist is not None:
        spec, label = dist
        head += f", process_mesh={spec.mesh!r}, placements={list(spec.placements)!r}, {label}"
        if value is None:
            return head + ")"
        head += "="
    elif value is None:
        return head + ", no values)"
    else:
        head += ","
    return f"{head}\n{' ' * indent}{format_value(to_numpy(value), indent)})"


__all__ = ["format_value", "held_value", "place_of", "tensor_text"]
