"""Placements: what a tensor looks like along one mesh axis.

* ``Shard(d)``: tensor dim ``d`` is split across the axis (chunking rule in ``spec.py``).
* ``Replicate()``: every rank along the axis holds the same value.
* ``Partial(op)``: every rank holds a partial value; reducing them with ``op`` over the axis
  gives the value. ``op`` is one of sum, avg, max, min.
* ``ZigzagShard(d)``: the load-balanced split of a causal sequence (context parallelism):
  dim ``d`` cut in ``2k`` equal chunks over the ``k`` ranks of the axis, rank ``r`` holding
  chunks ``r`` and ``2k-1-r`` (one early, one late), so every rank's causal attention work is
  the same. A kind of ``Shard`` (rules that treat a dim's elements alike propagate it as one);
  the storage order it implies is in ``spec.py``.

Each has a readable ``repr`` (``Shard(dim=0)``) and a compact ``str`` (``S(0)``, ``R``,
``P(sum)``, ``Z(1)``); ``parse_placements`` reads the compact form back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpipar.mesh import ProcessMesh

REDUCE_TYPES = ("sum", "avg", "max", "min")


class ReduceType:
    """Paddle's names for the reduce types (``dist.ReduceType.kRedSum`` ...)."""

    kRedSum = "sum"
    kRedAvg = "avg"
    kRedMax = "max"
    kRedMin = "min"


class Placement:
    """Base of the three placements."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicated(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim) needs an int tensor dim, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def get_dim(self) -> int:
        return self.dim

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class ZigzagShard(Shard):
    """Tensor dim ``dim`` split load-balanced: rank r of k holds chunks r and 2k-1-r of 2k.

    Equal to no plain ``Shard``: ``reshard`` converts between the two (and to and from
    ``Replicate``), reordering the dim's chunks on the way."""

    def __repr__(self) -> str:
        return f"ZigzagShard(dim={self.dim})"

    def __str__(self) -> str:
        return f"Z({self.dim})"


def like(p: Shard, dim: int) -> Shard:
    """A shard of ``dim`` of the same kind as ``p`` (plain or zigzag): what a rule that maps one
    tensor dim onto another, keeping its elements in order, gives the output."""
    return ZigzagShard(dim) if isinstance(p, ZigzagShard) else Shard(dim)


@dataclass(frozen=True)
class Replicate(Placement):
    def is_replicated(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    reduce_type: str = "sum"

    def __post_init__(self) -> None:
        rt = self.reduce_type
        # Accept Paddle's enum-like spellings ("kRedSum", "ReduceType.kRedSum").
        if isinstance(rt, str):
            norm = rt.rsplit(".", 1)[-1]
            norm = {"kRedSum": "sum", "kRedAvg": "avg", "kRedMax": "max", "kRedMin": "min"}.get(norm, norm)
            object.__setattr__(self, "reduce_type", norm)
        if self.reduce_type not in REDUCE_TYPES:
            raise ValueError(f"Partial reduce_type must be one of {', '.join(REDUCE_TYPES)}, got {rt!r}")

    def is_partial(self) -> bool:
        return True

    @property
    def linear(self) -> bool:
        """sum and avg commute with each other and with linear ops; max and min do not."""
        return self.reduce_type in ("sum", "avg")

    def __repr__(self) -> str:
        return f"Partial(reduce_type={self.reduce_type!r})"

    def __str__(self) -> str:
        return f"P({self.reduce_type})"


_TOKEN = re.compile(r"\s*(?:([SZ])\(\s*(-?\d+)\s*\)|R|P(?:\(\s*(\w+)\s*\))?)\s*,?")


def parse_placements(text: str) -> list[Placement]:
    """Read placements written compactly: ``"S(0)R"``, ``"[S(1), P(sum)]"``, ``"P"``, ``"Z(1)"``."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    out: list[Placement] = []
    pos = 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse placements {text!r} at position {pos}: {body[pos:]!r}")
        token = m.group(0).strip().rstrip(",").strip()
        if token.startswith("S"):
            out.append(Shard(int(m.group(2))))
        elif token.startswith("Z"):
            out.append(ZigzagShard(int(m.group(2))))
        elif token == "R":
            out.append(Replicate())
        else:
            out.append(Partial(m.group(3) or "sum"))
        pos = m.end()
    return out


def placements_str(placements: Sequence[Placement]) -> str:
    """Compact form of a placement list: ``S(0)R``."""
    return "".join(str(p) for p in placements)


def check_placements(placements: object, what: str = "placements") -> list[Placement]:
    """Return ``placements`` as a list, refusing anything that is not a placement."""
    if isinstance(placements, str):
        return parse_placements(placements)
    if isinstance(placements, Placement):
        raise TypeError(f"{what} must be a list with one placement per mesh axis, got {placements!r}")
    try:
        items = list(placements)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what} must be a list of placements, got {placements!r}") from None
    for i, p in enumerate(items):
        if not isinstance(p, Placement):
            raise TypeError(
                f"{what}[{i}] is {p!r}; use dist.Shard(dim), dist.ZigzagShard(dim), dist.Replicate() or dist.Partial()"
            )
    return items


def zigzag_fault(
    placements: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[int, int, int | None] | None:
    """The first zigzag split ``DistSpec`` refuses, as ``(axis, dim, outer)``: the mesh axis of the
    ``Z(dim)`` at fault and, when an earlier mesh axis splits the same dim (a zigzag split must be
    the outermost), that axis; ``outer`` None: the dim does not divide into 2 x (axis size) equal
    chunks. None when every zigzag split is one mpipar makes. Shard dims must be in range;
    negative ones count from the end."""
    ndim = len(shape)
    for axis, p in enumerate(placements):
        if not isinstance(p, ZigzagShard):
            continue
        dim = p.dim % ndim
        outer = next((a for a, q in enumerate(placements[:axis]) if isinstance(q, Shard) and q.dim % ndim == dim), None)
        if outer is not None:
            return axis, dim, outer
        k = mesh_shape[axis]
        if k > 1 and shape[dim] % (2 * k):
            return axis, dim, None
    return None


def placement_problem(
    text: str,
    mesh_ndim: int,
    tensor_ndim: int,
    shape: Sequence[int] | None = None,
    mesh_shape: Sequence[int] | None = None,
) -> str | None:
    """Why ``text`` cannot be the placements of a ``tensor_ndim``-d tensor on a ``mesh_ndim``-d
    mesh (the checks ``DistSpec`` makes), or None when it can. For files read from elsewhere
    (plans, checkpoints), which must describe only layouts mpipar could have made. With the
    tensor's ``shape`` and the mesh's ``mesh_shape`` a zigzag split is checked as ``DistSpec``
    checks it too: the outermost split of its dim, the dim dividing into 2 x (axis size) chunks."""
    try:
        placements = parse_placements(text)
    except (TypeError, ValueError) as exc:
        return f"is not a placement list ({exc}); write e.g. 'S(0)R'"
    if len(placements) != mesh_ndim:
        return f"has {len(placements)} placement(s) for a mesh of {mesh_ndim} axes"
    kinds = set()
    for p in placements:
        if isinstance(p, Shard) and not -tensor_ndim <= p.dim < tensor_ndim:
            return f"shards dim {p.dim} of a {tensor_ndim}-d tensor"
        if isinstance(p, Partial):
            kinds.add(p.reduce_type)
    if shape is not None and mesh_shape is not None and (fault := zigzag_fault(placements, shape, mesh_shape)):
        axis, dim, outer = fault
        if outer is not None:
            return f"splits dim {dim} on mesh axis {outer} outside its zigzag split {placements[axis]} on axis {axis}"
        k = mesh_shape[axis]
        return (
            f"splits dim {dim} of size {shape[dim]} zigzag over {k} ranks (axis {axis}): "
            f"it does not divide into 2 x {k} = {2 * k} equal chunks"
        )
    if len(kinds) > 1 and not kinds <= {"sum", "avg"}:
        return "mixes Partial reduce types that do not commute"
    return None


def is_shard_spec(spec: object) -> bool:
    """Is ``spec`` Paddle's older shard spec (per tensor dim a mesh axis name or None, as in
    ``shard_tensor(x, mesh, [None, "mp"])``) rather than a list of placements?"""
    return isinstance(spec, (list, tuple)) and all(s is None or isinstance(s, str) for s in spec)


def shard_spec_placements(spec: Sequence[Any], mesh: ProcessMesh, ndim: int, what: str) -> list[Placement]:
    """The placements (one per mesh axis) of shard spec ``spec`` for a ``ndim``-d tensor on ``mesh``."""
    if len(spec) != ndim:
        raise ValueError(
            f"{what}: shard spec {list(spec)} has {len(spec)} entries for a tensor with {ndim} dims "
            "(one mesh axis name or None per tensor dim)"
        )
    placements: list[Placement] = [Replicate()] * mesh.ndim
    for d, axis in enumerate(spec):
        if axis is None:
            continue
        k = mesh.axis_index(axis)
        if placements[k] != Replicate():
            raise ValueError(f"{what}: shard spec {list(spec)} names mesh axis {axis!r} for two tensor dims")
        placements[k] = Shard(d)
    return placements
