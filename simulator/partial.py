"""Genuinely partial tensors: random per-rank contributions that reduce to a given value.

``dist.shard_tensor`` splits a value into Partial exactly (one rank holds it, the others the
reduction's identity), which hides bugs: ``relu`` of zeros is zero, so a rule wrongly letting
a Partial through relu would still give the right answer. Checkers and tests use these
decompositions instead: every rank of a Partial axis holds a different random value.

* sum/avg: random contributions; the first coordinate absorbs the remainder so that the
  sum (times the avg axes' sizes) is the value;
* max (min): every contribution is below (above) the value, and a random coordinate per
  element holds the value itself.
"""

from __future__ import annotations

import numpy as np

import mpipar as dist
from mpipar.spec import DistSpec, box_shape


def partial_contributions(value: np.ndarray, spec: DistSpec, rng: np.random.Generator) -> np.ndarray:
    """An array ``(*partial_axis_sizes, *value.shape)`` of contributions reducing to ``value``."""
    axes = spec.partial_axes
    sizes = [spec.mesh.shape[a] for a in axes]
    if not axes:
        return value.copy()
    n = int(np.prod(sizes))
    types = {spec.placements[a].reduce_type for a in axes}  # type: ignore[union-attr]
    flat_shape = (n, *value.shape)
    if types <= {"sum", "avg"}:
        scale = int(np.prod([spec.mesh.shape[a] for a in axes if spec.placements[a].reduce_type == "avg"]))  # type: ignore[union-attr]
        parts = rng.standard_normal(flat_shape).astype(value.dtype) * value.dtype.type(
            max(1.0, float(np.abs(value).mean())) if value.size else 1.0
        )
        parts[0] = value * value.dtype.type(scale) - parts[1:].sum(axis=0)
    else:
        (op,) = types
        noise = np.abs(rng.standard_normal(flat_shape)).astype(value.dtype) + value.dtype.type(0.1)
        parts = value[None] - noise if op == "max" else value[None] + noise
        winner = rng.integers(0, n, size=value.shape)
        np.put_along_axis(parts, winner[None], value[None], axis=0)
    return parts.reshape((*sizes, *value.shape))


def random_partial_tensor(value: np.ndarray, spec: DistSpec, rng: np.random.Generator) -> dist.Tensor:
    """A distributed tensor laid out as ``spec`` whose Partial shards are random contributions."""
    value = np.asarray(value)
    if not spec.partial_axes or not np.issubdtype(value.dtype, np.floating):
        return dist.shard_tensor(value, spec.mesh, list(spec.placements))
    parts = partial_contributions(value, spec, rng)

    def local(rank: int) -> np.ndarray:
        coord = spec.mesh.coordinate(rank)
        contribution = parts[tuple(coord[a] for a in spec.partial_axes)]
        box = spec.local_box(rank)
        out = np.empty(box_shape(box), dtype=contribution.dtype)
        for index, gbox in spec.global_pieces(box):  # one piece, or a zigzag split's chunks
            out[index] = contribution[tuple(slice(s, e) for s, e in gbox)]
        return out

    return dist.dtensor_from_local(local, spec.mesh, list(spec.placements), shape=spec.shape)
