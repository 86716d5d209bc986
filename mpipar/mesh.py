"""ProcessMesh: an N-d array of process ids with named axes.

A mesh is the coordinate system placements refer to: placement ``i`` of a tensor says what
happens along mesh axis ``i``. "Axis" always means a mesh axis here; "dim" a tensor dimension.

    >>> mesh = ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    >>> mesh.coordinate(1)
    (1, 1)
    >>> mesh.rank_group(axis="y", rank=1)
    (0, 1, 3)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

import numpy as np


class ProcessMesh:
    """An N-d mesh of process ids. Equality and hash are by value (shape, ids, names).

    A pure value: building one checks only the ids themselves (rectangular, non-negative, each
    once), never a backend. Whether the world has those ranks is asked where a mesh meets a
    backend (``mpipar.backend.check_mesh``: shard_tensor, reshard, dtensor_from_local), so a
    plan of a 1024-rank world can be read in a process that hosts none of it.
    """

    __slots__ = ("__dict__", "_dim_names", "_ids")
    _ids: np.ndarray
    _dim_names: tuple[str, ...]

    def __init__(self, mesh: Any, dim_names: Sequence[str] | None = None) -> None:
        if isinstance(mesh, ProcessMesh):
            ids = mesh._ids
            dim_names = dim_names if dim_names is not None else mesh.dim_names
        else:
            ids = _as_id_array(mesh)
        if dim_names is None:
            dim_names = [f"d{i}" for i in range(ids.ndim)]
        dim_names = [str(n) for n in dim_names]
        if len(dim_names) != ids.ndim:
            raise ValueError(
                f"ProcessMesh of shape {list(ids.shape)} has {ids.ndim} axes but "
                f"{len(dim_names)} dim_names {dim_names} were given; give one name per axis"
            )
        if len(set(dim_names)) != len(dim_names):
            raise ValueError(f"ProcessMesh dim_names {dim_names} contain a duplicate name")
        flat = ids.reshape(-1)
        if flat.size == 0:
            raise ValueError(f"ProcessMesh of shape {list(ids.shape)} has no process")
        if (flat < 0).any():
            raise ValueError(f"ProcessMesh process ids must be >= 0, got {flat.tolist()}")
        uniq, counts = np.unique(flat, return_counts=True)
        if (counts > 1).any():
            dups = uniq[counts > 1].tolist()
            raise ValueError(
                f"ProcessMesh {ids.tolist()} names process id(s) {dups} more than once; "
                "every process may appear in a mesh only once"
            )
        ids = ids.copy()
        ids.flags.writeable = False
        self._ids = ids
        self._dim_names = tuple(dim_names)

    # ----------------------------------------------------------------------- basic views
    @property
    def shape(self) -> list[int]:
        return list(self._ids.shape)

    @property
    def ndim(self) -> int:
        return self._ids.ndim

    @property
    def size(self) -> int:
        return int(self._ids.size)

    @property
    def dim_names(self) -> list[str]:
        return list(self._dim_names)

    @property
    def process_ids(self) -> list[int]:
        return self._ids.reshape(-1).tolist()

    @property
    def mesh(self) -> np.ndarray:
        """The id array (read-only)."""
        return self._ids

    @cached_property
    def _id_tuple(self) -> tuple[int, ...]:
        return tuple(self.process_ids)

    @cached_property
    def _id_set(self) -> frozenset[int]:
        """The mesh's process ids as a set (made once: ``full_tensor`` asks on every call
        whether the mesh holds every rank)."""
        return frozenset(self._id_tuple)

    @cached_property
    def _coords(self) -> dict[int, tuple[int, ...]]:
        return {int(pid): tuple(int(c) for c in idx) for idx, pid in np.ndenumerate(self._ids)}

    def axis_index(self, axis: int | str) -> int:
        """Normalise an axis given by index or by name."""
        if isinstance(axis, str):
            if axis not in self._dim_names:
                raise ValueError(f"mesh {self} has no axis named {axis!r}; axes are {self.dim_names}")
            return self._dim_names.index(axis)
        if not isinstance(axis, (int, np.integer)) or not -self.ndim <= axis < self.ndim:
            raise ValueError(f"mesh {self} has no axis {axis!r}; it has {self.ndim} axes")
        return int(axis) % self.ndim

    def get_dim_size(self, axis: int | str) -> int:
        return self._ids.shape[self.axis_index(axis)]

    def contains(self, rank: int) -> bool:
        return rank in self._coords

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, (int, np.integer)) and int(rank) in self._coords

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The coordinate of ``rank`` in the mesh."""
        try:
            return self._coords[int(rank)]
        except KeyError:
            raise ValueError(f"process {rank} is not in mesh {self}") from None

    def rank_at(self, coord: Sequence[int]) -> int:
        return int(self._ids[tuple(coord)])

    def rank_group(self, axis: int | str, rank: int) -> tuple[int, ...]:
        """The ranks along mesh ``axis`` through ``rank`` (in axis order)."""
        a = self.axis_index(axis)
        coord = list(self.coordinate(rank))
        return tuple(self.rank_at([*coord[:a], i, *coord[a + 1 :]]) for i in range(self.shape[a]))

    def groups(self, axes: Sequence[int | str]) -> list[tuple[int, ...]]:
        """Partition the mesh into the rank groups spanned by ``axes``.

        Members of a group share their coordinates on every other axis; inside a group,
        members are ordered row-major over ``axes`` taken in the given order (the flattened
        group a collective over several axes runs on).
        """
        key = tuple(axes)
        cached = self._groups_cache.get(key)
        if cached is None:
            # Every collective of every reshard asks this: worth a dict lookup, not a transpose.
            idx = [self.axis_index(a) for a in key]
            others = [a for a in range(self.ndim) if a not in idx]
            moved = np.transpose(self._ids, others + idx)
            cached = [
                tuple(int(x) for x in g.reshape(-1)) for g in moved.reshape(-1, _prod(self.shape[a] for a in idx))
            ]
            self._groups_cache[key] = cached
        return list(cached)

    @cached_property
    def _groups_cache(self) -> dict[tuple[int | str, ...], list[tuple[int, ...]]]:
        return {}

    # --------------------------------------------------------------------- sub-meshes
    def __getitem__(self, index: Any) -> ProcessMesh:
        sub = self._ids[index]
        if np.ndim(sub) == 0:
            return ProcessMesh([int(sub)], dim_names=[self._dim_names[-1]])
        kept = _kept_axes(self.ndim, index)
        return ProcessMesh(sub, dim_names=[self._dim_names[a] for a in kept])

    def get_mesh_with_dim(self, dim_name: str, index: int | None = None) -> ProcessMesh:
        """Paddle's helper: the mesh with ``dim_name`` moved first, or its ``index``-th slice."""
        a = self.axis_index(dim_name)
        order = [a] + [i for i in range(self.ndim) if i != a]
        names = [self._dim_names[i] for i in order]
        moved = ProcessMesh(np.transpose(self._ids, order), dim_names=names)
        return moved if index is None else moved[index]

    @classmethod
    def by_hosts(
        cls, shape: Sequence[int], dim_names: Sequence[str], hosts: Sequence[str], inner: Sequence[str] = ("tp",)
    ) -> ProcessMesh:
        """A mesh of ``shape`` whose groups along the ``inner`` axes hold ranks of one host.

        ``hosts`` is each rank's host (``mpipar.rank_hosts()`` under ``mpipar launch --hosts``).
        The ranks are taken host by host (hosts in order of their first rank, each host's ranks
        ascending) and filled into the mesh with the ``inner`` axes varying fastest, so each
        inner group is a run of one host's ranks; each host must hold a multiple of the inner
        group size::

            >>> ProcessMesh.by_hosts([2, 2], ["dp", "tp"], ["a", "b", "a", "b"])   # hydra placed ranks cyclically
            ProcessMesh([[0, 2], [1, 3]], dim_names=['dp', 'tp'])
        """
        names = [str(n) for n in dim_names]
        dims = [int(d) for d in shape]
        if len(names) != len(dims):
            raise ValueError(f"by_hosts: shape {dims} has {len(dims)} axes but dim_names {names} has {len(names)}")
        missing = [a for a in inner if a not in names]
        if missing:
            raise ValueError(f"by_hosts: inner axes {missing} are not among the mesh's dim_names {names}")
        size = _prod(dims)
        if len(hosts) != size:
            raise ValueError(
                f"by_hosts: the mesh {'x'.join(map(str, dims))} has {size} ranks but {len(hosts)} hosts were given"
            )
        group = _prod(dims[names.index(a)] for a in inner)
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(str(h), []).append(r)
        for h, rs in by_host.items():
            if len(rs) % group:
                inner_text = " * ".join(f"{a}({dims[names.index(a)]})" for a in inner)
                raise ValueError(
                    f"by_hosts: host {h!r} holds {len(rs)} ranks, not a multiple of {inner_text} = {group}; "
                    f"a group along {list(inner)} cannot stay inside it"
                )
        order = [r for rs in by_host.values() for r in rs]
        outer_axes = [i for i, n in enumerate(names) if n not in inner]
        inner_axes = [names.index(a) for a in inner]
        permuted = np.array(order).reshape([dims[i] for i in outer_axes + inner_axes])
        return cls(np.transpose(permuted, np.argsort(outer_axes + inner_axes)), dim_names=names)

    # --------------------------------------------------------------------- value object
    def _key(self) -> tuple[Any, ...]:
        return (tuple(self._ids.shape), self._id_tuple, self._dim_names)

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, ProcessMesh) and self._key() == other._key())

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        # Meshes key every spec and plan cache: hash the id tuple once, not per lookup.
        return hash(self._key())

    def same_layout(self, other: ProcessMesh) -> bool:
        """Same shape and ids; names ignored (reshard treats such meshes as one)."""
        return self._ids.shape == other._ids.shape and self._id_tuple == other._id_tuple

    def __iter__(self) -> Iterator[int]:
        return iter(self.process_ids)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"ProcessMesh({self._ids.tolist()}, dim_names={list(self._dim_names)})"

    def __str__(self) -> str:
        axes = ",".join(f"{n}={s}" for n, s in zip(self._dim_names, self._ids.shape, strict=True))
        if self.size <= 16:
            return f"mesh[{axes}]{self._ids.tolist()}"
        ids = self.process_ids
        span = (
            f"{ids[0]}..{ids[-1]}"
            if ids == list(range(ids[0], ids[0] + len(ids)))
            else f"{ids[0]}, {ids[1]}, ..., {ids[-1]}"
        )
        return f"mesh[{axes}]({self.size} ranks: {span})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ProcessMesh, (self._ids.tolist(), list(self._dim_names)))

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "process_ids": self.process_ids, "dim_names": self.dim_names}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessMesh:
        ids = np.asarray(data["process_ids"], dtype=np.int64).reshape(data["shape"])
        return cls(ids, dim_names=data["dim_names"])


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _as_id_array(mesh: Any) -> np.ndarray:
    try:
        arr = np.asarray(mesh)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"ProcessMesh ids {mesh!r} are not a rectangular array: {exc}") from None
    if arr.ndim == 0 or arr.dtype == object:
        raise ValueError(f"ProcessMesh needs a rectangular list or array of process ids, got {mesh!r}")
    if np.issubdtype(arr.dtype, np.floating) and np.all(np.mod(arr, 1) == 0):
        arr = arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer) and arr.size:
        raise ValueError(f"ProcessMesh ids must be integers, got {mesh!r}")
    return arr.astype(np.int64)


def _kept_axes(ndim: int, index: Any) -> list[int]:
    """Which mesh axes survive numpy basic indexing by ``index`` (ints drop an axis)."""
    if not isinstance(index, tuple):
        index = (index,)
    kept: list[int] = []
    axis = 0
    for item in index:
        if item is Ellipsis:
            rest = ndim - axis - (len(index) - index.index(Ellipsis) - 1)
            kept.extend(range(axis, axis + rest))
            axis += rest
        elif isinstance(item, (int, np.integer)):
            axis += 1
        elif isinstance(item, slice):
            kept.append(axis)
            axis += 1
        else:
            raise ValueError(f"ProcessMesh index {index!r}: only ints, slices and ... are supported")
    kept.extend(range(axis, ndim))
    return kept
