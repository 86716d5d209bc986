"""DistSpec: the global shape, mesh and placements of a distributed tensor, and the chunking rule.

The chunking rule (every path in mpipar honours it)
---------------------------------------------------
A tensor dim of size ``n`` split over a mesh axis of size ``k`` gives chunk ``i`` the
half-open range ``[start_i, start_i + len_i)`` with::

    len_i = n // k + (1 if i < n % k else 0)      # the first n % k chunks are one longer

(NumPy's ``array_split``). Chunks may be empty when ``n < k``.

Several mesh axes sharding one dim nest in increasing axis order: the lowest-index axis
splits the dim first, each later axis splits the chunk it is given. On a 2x2 mesh with
placements ``[Shard(0), Shard(0)]`` and a dim of size 5::

    coord (x, y)   outer chunk (x)   inner chunk (y)   rows
    (0, 0)         [0, 3)            [0, 2)            0 1
    (0, 1)         [0, 3)            [2, 3)            2
    (1, 0)         [3, 5)            [3, 4)            3
    (1, 1)         [3, 5)            [4, 5)            4

The load-balanced split ``ZigzagShard(d)`` on an axis of ``k`` ranks is the outermost split of
dim ``d`` (no lower-index axis may shard ``d``) and needs ``d``'s size to divide into ``2k``
equal chunks. It is a plain ``Shard`` of the dim held in *storage order*
(``zigzag_order(n, k)``): position ``i`` of that order holds global element ``order[i]``. The
boxes of the spec (``boxes``, ``box_at``, the reshard planner's and the kernels') are in storage
order; ``global_pieces`` and ``positions`` translate them to global positions. With ``k = 2``,
``n = 8``, ``[ZigzagShard(0), Shard(0)]`` on a 2x2 mesh::

    coord (x, y)   storage box   global rows
    (0, 0)         [0, 2)        0 1
    (0, 1)         [2, 4)        6 7
    (1, 0)         [4, 6)        2 3
    (1, 1)         [6, 8)        4 5

Partial placements of one spec must commute: sum and avg may mix; max and min each stand
alone. The global value is the local values reduced over every Partial axis.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from mpipar.mesh import ProcessMesh
from mpipar.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    ZigzagShard,
    check_placements,
    like,
    parse_placements,
    placements_str,
    zigzag_fault,
)

Box = tuple[tuple[int, int], ...]
"""A box of a tensor: one half-open ``(start, stop)`` range per tensor dim."""


@functools.lru_cache(maxsize=2048)  # bounded: an entry of a 1024-rank mesh holds 1024 boxes
def _boxes_in_mesh_order(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], shards: tuple[tuple[int, ...], ...]
) -> tuple[Box, ...]:
    """``DistSpec.box_at`` of every mesh coordinate, row-major (the order of ``ProcessMesh.process_ids``)."""
    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        box = []
        for n, axes in zip(shape, shards, strict=True):
            start, stop = 0, n
            for a in axes:
                s, e = chunk_range(stop - start, mesh_shape[a], coord[a])
                start, stop = start + s, start + e
            box.append((start, stop))
        out.append(tuple(box))
    return tuple(out)


@functools.lru_cache(maxsize=2048)
def _shapes_in_mesh_order(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], shards: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    return tuple(box_shape(b) for b in _boxes_in_mesh_order(shape, mesh_shape, shards))


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` chunks of ``range(size)`` under the chunking rule."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def zigzag_order(length: int, parts: int) -> np.ndarray:
    """Global positions in the order a ``parts``-way zigzag split holds them: the sequence cut in
    ``2 * parts`` chunks, part r holding chunks r and 2*parts-1-r (one early, one late), so each
    part's causal attention work is the same. ``zigzag_order(8, 2)`` is 0 1 6 7 2 3 4 5.

    | part | chunks   | positions (length 8) |
    |------|----------|----------------------|
    | 0    | 0 and 3  | 0 1, 6 7             |
    | 1    | 1 and 2  | 2 3, 4 5             |
    """
    if parts < 1 or length % (2 * parts):
        raise ValueError(
            f"zigzag order: the sequence length {length} must divide into 2 x cp({parts}) = {2 * parts} equal chunks"
        )
    return _zigzag_order(length, parts)


@functools.lru_cache(maxsize=64)
def _zigzag_order(length: int, parts: int) -> np.ndarray:
    c = length // (2 * parts)
    out = np.concatenate(
        [np.r_[r * c : (r + 1) * c, (2 * parts - 1 - r) * c : (2 * parts - r) * c] for r in range(parts)]
    ).astype(np.int64)
    out.flags.writeable = False
    return out


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(e - s for s, e in box)


def box_numel(box: Box) -> int:
    out = 1
    for s, e in box:
        out *= e - s
    return out


def box_intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap (an empty box is None)."""
    out = []
    for (s1, e1), (s2, e2) in zip(a, b, strict=True):
        s, e = max(s1, s2), min(e1, e2)
        if s >= e:
            return None
        out.append((s, e))
    return tuple(out)


def box_relative(inner: Box, outer: Box) -> tuple[Any, ...]:
    """The index that cuts ``inner`` out of an array holding ``outer``.

    For 0-d tensors this is ``(...,)``: indexing with ``()`` would return a NumPy scalar
    instead of a 0-d array view.
    """
    return tuple(slice(s - os, e - os) for (s, e), (os, _) in zip(inner, outer, strict=True)) or (Ellipsis,)


def slabs_in_order(box: Box, boxes: Sequence[Box]) -> bool:
    """Do ``boxes``, in this order, tile ``box`` as consecutive ranges of its first dim?"""
    if not box or not boxes or boxes[0][0][0] != box[0][0] or boxes[-1][0][1] != box[0][1]:
        return False
    rest = box[1:]
    return all(b[1:] == rest for b in boxes) and all(a[0][1] == b[0][0] for a, b in itertools.pairwise(boxes))


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _check_zigzag(shape: tuple[int, ...], mesh: ProcessMesh, placements: Sequence[Placement]) -> None:
    """A zigzag split is the outermost split of its dim, and the dim divides into 2k chunks
    (``zigzag_fault``, which plan and checkpoint readers ask too)."""
    fault = zigzag_fault(placements, shape, mesh.shape)
    if fault is None:
        return
    axis, dim, outer = fault
    k = mesh.shape[axis]
    where = f"placement Z({dim}) on mesh axis {axis} ({mesh.dim_names[axis]!r}, {k} ranks)"
    if outer is not None:
        raise ValueError(
            f"{where}: tensor dim {dim} is already split by mesh axis {outer} "
            f"({mesh.dim_names[outer]!r}); a zigzag split must be the outermost split of its dim"
        )
    raise ValueError(
        f"{where}: tensor dim {dim} of size {shape[dim]} (shape {list(shape)}) does not divide into "
        f"2 x {k} = {2 * k} equal chunks; pad the sequence or use Shard({dim})"
    )


@dataclass(frozen=True)
class DistSpec:
    """Global ``shape``, ``mesh`` and one placement per mesh axis. A value object."""

    shape: tuple[int, ...]
    mesh: ProcessMesh
    placements: tuple[Placement, ...]

    def __init__(self, shape: Sequence[int], mesh: ProcessMesh, placements: Sequence[Placement]) -> None:
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"DistSpec mesh must be a dist.ProcessMesh, got {type(mesh).__name__}")
        try:
            shape_t = tuple(int(n) for n in shape)
        except (TypeError, ValueError):
            raise TypeError(f"DistSpec shape must be a sequence of ints, got {shape!r}") from None
        if any(n < 0 for n in shape_t):
            raise ValueError(f"DistSpec shape {list(shape_t)} has a negative size")
        pls = check_placements(placements)
        if len(pls) != mesh.ndim:
            raise ValueError(
                f"{len(pls)} placements {placements_str(pls)} given for mesh {mesh} with "
                f"{mesh.ndim} axes {mesh.dim_names}; give exactly one placement per mesh axis"
            )
        norm: list[Placement] = []
        for axis, p in enumerate(pls):
            if isinstance(p, Shard):
                d = p.dim + len(shape_t) if p.dim < 0 else p.dim
                if not 0 <= d < len(shape_t):
                    raise ValueError(
                        f"placement {type(p).__name__}({p.dim}) on mesh axis {axis} ({mesh.dim_names[axis]!r}) "
                        f"names tensor dim {p.dim}, but the tensor of shape {list(shape_t)} has "
                        f"{len(shape_t)} dims"
                    )
                p = like(p, d)
            norm.append(p)
        _check_zigzag(shape_t, mesh, norm)
        partial_types = {p.reduce_type for p in norm if isinstance(p, Partial)}
        if len(partial_types) > 1 and not partial_types <= {"sum", "avg"}:
            raise ValueError(
                f"placements {placements_str(norm)} mix Partial reduce types {sorted(partial_types)} "
                "that do not commute; only sum and avg may be mixed in one spec"
            )
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", tuple(norm))

    def __hash__(self) -> int:
        # Computed once: every reshard looks its plan up by (source, destination) spec, and
        # the generated hash would call into the mesh and each placement every time.
        return self._hash

    def __eq__(self, other: object) -> bool:
        # A step compares the same few spec objects over and over (the optimizer's layout
        # checks, the decision keys): identity first, then the cached hashes, which differ for
        # almost every unequal pair, and only then the fields.
        if other is self:
            return True
        if type(other) is not DistSpec:
            return NotImplemented
        return (
            self._hash == other._hash
            and self.shape == other.shape
            and self.placements == other.placements
            and self.mesh == other.mesh
        )

    @cached_property
    def zigzag(self) -> dict[int, int]:
        """The dims held in zigzag storage order and each one's degree (ranks of its axis)."""
        return {
            p.dim: self.mesh.shape[a]
            for a, p in enumerate(self.placements)
            if isinstance(p, ZigzagShard) and self.mesh.shape[a] > 1
        }

    def storage_order(self, dim: int) -> np.ndarray | None:
        """The global positions of ``dim`` in storage order, or None when it is the natural order."""
        k = self.zigzag.get(dim)
        return None if k is None else _zigzag_order(self.shape[dim], k)

    def positions(self, box: Box, dim: int) -> np.ndarray:
        """The global positions along ``dim`` of the elements of storage box ``box``."""
        s, e = box[dim]
        order = self.storage_order(dim)
        return np.arange(s, e) if order is None else order[s:e]

    def global_pieces(self, box: Box) -> list[tuple[tuple[Any, ...], Box]]:
        """Storage box ``box`` as (index into the local array, global box) pieces, in order: one
        piece, or more where it spans chunks of a zigzag dim."""
        pieces: list[tuple[tuple[Any, ...], Box]] = [((), ())]
        for d, (s, e) in enumerate(box):
            runs = [(s, e, s)]
            k = self.zigzag.get(d)
            if k is not None and e > s:
                c = self.shape[d] // (2 * k)
                order = _zigzag_order(self.shape[d], k)
                runs = []
                i = s
                while i < e:
                    j = min(e, (i // c + 1) * c)
                    runs.append((i, j, int(order[i])))
                    i = j
            pieces = [
                ((*idx, slice(i - s, j - s)), (*gbox, (g, g + j - i))) for idx, gbox in pieces for i, j, g in runs
            ]
        return pieces

    @cached_property
    def _hash(self) -> int:
        return hash((self.shape, self.mesh, self.placements))

    # --------------------------------------------------------------- Paddle's notation
    @classmethod
    def from_dims_mapping(
        cls,
        shape: Sequence[int],
        mesh: ProcessMesh,
        dims_mapping: Sequence[int],
        partial_dims: Sequence[int] = (),
        partial_type: str = "sum",
    ) -> DistSpec:
        """Build from Paddle's ``dims_mapping`` (mesh axis sharding each tensor dim, or -1)."""
        if len(dims_mapping) != len(shape):
            raise ValueError(
                f"dims_mapping {list(dims_mapping)} has {len(dims_mapping)} entries for a tensor "
                f"of shape {list(shape)}; give one per tensor dim"
            )
        pls: list[Placement] = [Replicate()] * mesh.ndim
        for dim, axis in enumerate(dims_mapping):
            if axis == -1 or axis is None:
                continue
            if not 0 <= axis < mesh.ndim:
                raise ValueError(f"dims_mapping {list(dims_mapping)}: mesh {mesh} has no axis {axis}")
            if not pls[axis].is_replicated():
                raise ValueError(f"dims_mapping {list(dims_mapping)} uses mesh axis {axis} twice")
            pls[axis] = Shard(dim)
        for axis in partial_dims:
            if not 0 <= axis < mesh.ndim or not pls[axis].is_replicated():
                raise ValueError(
                    f"partial_dims {list(partial_dims)}: axis {axis} is out of range or already shards a dim"
                )
            pls[axis] = Partial(partial_type)
        return cls(shape, mesh, pls)

    @property
    def dims_mapping(self) -> list[int]:
        out = [-1] * len(self.shape)
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard):
                if out[p.dim] != -1:
                    raise ValueError(
                        f"{self} shards tensor dim {p.dim} over several mesh axes; Paddle's "
                        "dims_mapping cannot express nested sharding"
                    )
                out[p.dim] = axis
        return out

    @property
    def partial_dims(self) -> list[int]:
        return [a for a, p in enumerate(self.placements) if isinstance(p, Partial)]

    # ----------------------------------------------------------------------- structure
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @cached_property
    def numel(self) -> int:
        return box_numel(full_box(self.shape))

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes sharding tensor ``dim``, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == dim)

    @cached_property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def is_partial(self) -> bool:
        return bool(self.partial_axes)

    @property
    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def box_at(self, coord: Sequence[int]) -> Box:
        """The global box held at mesh coordinate ``coord``."""
        box = []
        for d, n in enumerate(self.shape):
            start, stop = 0, n
            for a in self.shard_axes(d):
                s, e = chunk_range(stop - start, self.mesh.shape[a], coord[a])
                start, stop = start + s, start + e
            box.append((start, stop))
        return tuple(box)

    @cached_property
    def boxes(self) -> dict[int, Box]:
        """Every rank's global box, keyed by process id."""
        # The boxes depend on the shape, the mesh's shape and the shard axes only, not on which
        # processes hold them: computed once per layout and shared by every mesh of that shape
        # (a shape-only trace of a thousand ranks builds the same layouts on many stage meshes).
        shards = tuple(self.shard_axes(d) for d in range(len(self.shape)))
        return dict(
            zip(
                self.mesh.process_ids,
                _boxes_in_mesh_order(tuple(self.shape), tuple(self.mesh.shape), shards),
                strict=True,
            )
        )

    @cached_property
    def local_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Every rank's local shape, in ``mesh.process_ids`` order."""
        shards = tuple(self.shard_axes(d) for d in range(len(self.shape)))
        return _shapes_in_mesh_order(tuple(self.shape), tuple(self.mesh.shape), shards)

    def local_box(self, rank: int) -> Box:
        try:
            return self.boxes[rank]
        except KeyError:
            raise ValueError(f"process {rank} is not in mesh {self.mesh} of {self}") from None

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return box_shape(self.local_box(rank))

    @cached_property
    def max_local_numel(self) -> int:
        return max(box_numel(b) for b in self.boxes.values())

    @cached_property
    def cells(self) -> dict[Box, tuple[int, ...]]:
        """The distinct boxes and the ranks holding each (its replicas), in mesh order."""
        out: dict[Box, list[int]] = {}
        for r, b in self.boxes.items():
            out.setdefault(b, []).append(r)
        return {b: tuple(rs) for b, rs in out.items()}

    # ------------------------------------------------------------------------ variants
    def with_placements(self, placements: Sequence[Placement]) -> DistSpec:
        return DistSpec(self.shape, self.mesh, placements)

    def without_partial(self) -> DistSpec:
        """The same layout with every Partial read as Replicate (the reduced value's layout)."""
        return self._without_partial

    @cached_property
    def _without_partial(self) -> DistSpec:
        # Cached: every parameter asks for its gradient's layout every step (``grad_spec``).
        if not any(isinstance(p, Partial) for p in self.placements):
            return self
        return DistSpec(self.shape, self.mesh, [Replicate() if isinstance(p, Partial) else p for p in self.placements])

    @cached_property
    def replicated(self) -> DistSpec:
        """The same shape on the same mesh, replicated on every axis (what ``full_tensor`` gathers to)."""
        if all(isinstance(p, Replicate) for p in self.placements):
            return self
        return DistSpec(self.shape, self.mesh, [Replicate()] * self.mesh.ndim)

    def with_mesh(self, mesh: ProcessMesh, placements: Sequence[Placement] | None = None) -> DistSpec:
        return DistSpec(self.shape, mesh, self.placements if placements is None else placements)

    # ------------------------------------------------------------------------ printing
    @cached_property
    def placements_str(self) -> str:
        # Cached (the spec is immutable): a shape-only trace compares it on every op's tensors.
        return placements_str(self.placements)

    def natural(self) -> DistSpec:
        """The same layout with every zigzag split read as a plain ``Shard``."""
        if not any(isinstance(p, ZigzagShard) for p in self.placements):
            return self
        return self.with_placements([Shard(p.dim) if isinstance(p, ZigzagShard) else p for p in self.placements])

    def __repr__(self) -> str:
        return f"DistSpec(shape={list(self.shape)}, mesh={self.mesh!r}, placements={list(self.placements)!r})"

    def __str__(self) -> str:
        return f"{list(self.shape)}@{self.mesh}:{self.placements_str}"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "mesh": self.mesh.to_dict(), "placements": self.placements_str}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistSpec:
        return cls(data["shape"], ProcessMesh.from_dict(data["mesh"]), parse_placements(data["placements"]))


_INTERNED: dict[int, weakref.ref[DistSpec]] = {}
"""The kept spec per hash, held weakly: a spec caches its boxes, which on a large mesh are not
small, so the table never keeps one alive by itself."""


def _forget(ref: weakref.ref[DistSpec], key: int) -> None:
    if _INTERNED.get(key) is ref:
        del _INTERNED[key]


def interned(spec: DistSpec) -> DistSpec:
    """The one ``DistSpec`` object kept for every spec equal to ``spec`` (while one is held).

    Specs are values (frozen), so equal ones are interchangeable. Dispatch's decisions and the
    tensors holding shards use the kept object, so the comparisons a step makes over and over
    (a gradient's layout against its parameter's, a decision key's specs) are identity checks
    instead of field-by-field ones. Only a speed-up: two equal specs that are not one object
    (two unequal ones sharing a hash keep the later) still compare equal."""
    key = spec._hash
    ref = _INTERNED.get(key)
    if ref is not None:
        kept = ref()
        if kept is not None and (kept is spec or kept == spec):
            return kept
    _INTERNED[key] = weakref.ref(spec, functools.partial(_forget, key=key))
    return spec
