"""What a checkpoint stores and who writes it, computed on every rank from the specs alone.

``flatten_state`` walks a (nested) state dict into its array leaves (distributed and dense
``Tensor``s, NumPy arrays and scalars, named by their dotted path) and a JSON structure that
records the containers and every plain value (step counters, RNG state, loader positions).

``plan_chunks`` turns the leaves into *pieces*: every distinct box of a tensor's layout (a
*cell*, held by one or several replicas), cut along its outermost dims into contiguous pieces
of at most ``piece_bytes``, each assigned to one replica. The assignment depends only on
names, specs and the world size, so every rank computes the same chunk layout, file names and
byte offsets without communicating, and each replica is written exactly once:

    piece (in name order)        replicas        bytes so far per rank    owner
    emb#0  rows [0, 4)           0 1 2 3         0 0 0 0                  0  (fewest bytes, then lowest rank)
    emb#1  rows [4, 8)           0 1 2 3         64 0 0 0                 1
    w1#0   box of tp rank 0      0 2             64 64 0 0                2

Balancing by bytes spreads the writes of replicated tensors over their replicas instead of
piling them on the first data-parallel group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipar.checkpoint.format import st_dtype
from mpipar.placement import Partial, Placement, Replicate, Shard
from mpipar.spec import Box, DistSpec, box_numel, box_shape, full_box
from mpipar.tensor import Tensor
from mpipar.untrusted import printable

PIECE_BYTES = 16 << 20
"""Largest piece written as one chunk: bounds what a reader needing part of a chunk reads extra."""


@dataclass
class Leaf:
    """One array-valued entry of a state dict."""

    name: str
    kind: str
    """``dist`` (distributed Tensor), ``dense`` (dense Tensor), ``array`` (NumPy), ``scalar`` (NumPy scalar)."""
    value: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    spec: DistSpec | None = None
    stored_spec: DistSpec | None = None
    """The layout written: ``spec`` with every Partial axis reduced (set by the save)."""


@dataclass(frozen=True)
class Piece:
    """One chunk: the ``box`` of tensor ``name`` that rank ``owner`` writes, cut from its ``cell``."""

    name: str
    index: int
    box: Box
    cell: Box
    owner: int
    nbytes: int

    @property
    def key(self) -> str:
        return f"{self.name}#{self.index}"


@dataclass
class FilePlan:
    """What one writing rank puts in its file, in order, with byte offsets."""

    rank: int
    pieces: list[Piece] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return file_name(self.rank)


def file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


# =============================================================================== flatten
def flatten_state(state: Any) -> tuple[dict[str, Any], list[Leaf]]:
    """The JSON structure of ``state`` and its array leaves (in traversal order)."""
    if not isinstance(state, dict):
        raise TypeError(
            f"save_state_dict needs a dict of names to tensors and values, got {type(state).__name__}; "
            "wrap it: {'model': ...}"
        )
    leaves: list[Leaf] = []
    names: dict[str, tuple[Any, ...]] = {}
    structure = _encode(state, (), leaves, names)
    return structure, leaves


def _encode(value: Any, path: tuple[Any, ...], leaves: list[Leaf], names: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    if isinstance(value, Tensor):
        if value.is_dist:
            leaf = Leaf("", "dist", value, tuple(value.shape), value.dtype, spec=value.spec)
        else:
            leaf = Leaf("", "dense", value, tuple(value.shape), value.dtype)
        return _add_leaf(leaf, path, leaves, names)
    if isinstance(value, np.ndarray):
        return _add_leaf(Leaf("", "array", value, value.shape, value.dtype), path, leaves, names)
    if isinstance(value, np.generic):
        arr = np.asarray(value)
        return _add_leaf(Leaf("", "scalar", arr, (), arr.dtype), path, leaves, names)
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(
                    f"state key {k!r} ({type(k).__name__}) under {path_name(path)!r} is not a str or int; "
                    "checkpoints store str and int keys only"
                )
            if isinstance(k, str):
                _check_text(k, f"state key {printable(k)!r} under {printable(path_name(path))!r}")
            items.append([k, _encode(v, (*path, k), leaves, names)])
        return {"dict": items}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, (*path, i), leaves, names) for i, v in enumerate(value)]}
    if isinstance(value, str):
        _check_text(value, f"state entry {printable(path_name(path))!r}")
    if value is None or isinstance(value, (bool, int, str)):
        return {"value": value}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"value": value}
        return {"float": repr(value)}  # 'nan', 'inf', '-inf': JSON has no literal for them
    raise TypeError(
        f"state entry {path_name(path)!r} is a {type(value).__name__}, which a checkpoint cannot store; "
        "use a Tensor, a NumPy array, or a JSON-able value (int, float, str, bool, None, list, dict)"
    )


def _check_text(text: str, what: str) -> None:
    """Refuse a string UTF-8 cannot encode (a lone surrogate): metadata.json is UTF-8 text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} holds a lone surrogate, which UTF-8 (and so a checkpoint) cannot store: "
            f"{printable(text)!r}; decode the text it came from properly"
        ) from None


def _add_leaf(
    leaf: Leaf, path: tuple[Any, ...], leaves: list[Leaf], names: dict[str, tuple[Any, ...]]
) -> dict[str, Any]:
    name = path_name(path)
    if name in names:
        raise ValueError(
            f"state entries {list(names[name])} and {list(path)} both flatten to the name {name!r}; "
            "rename one (names join nested keys with '.')"
        )
    if leaf.dtype == object:
        raise TypeError(f"state entry {name!r} is an object array; store numeric arrays only")
    st_dtype(leaf.dtype, f"state entry {name!r}")
    names[name] = path
    leaf.name = name
    leaves.append(leaf)
    return {leaf.kind: name}


def decode_value(node: dict[str, Any]) -> Any:
    """A plain (array-free) structure node back to its Python value."""
    if "value" in node:
        return node["value"]
    if "float" in node:
        return float(node["float"])
    if "dict" in node:
        return {k: decode_value(v) for k, v in node["dict"]}
    if "list" in node:
        return [decode_value(v) for v in node["list"]]
    if "tuple" in node:
        return tuple(decode_value(v) for v in node["tuple"])
    raise AssertionError(f"not a plain node: {node}")


# =============================================================================== layout
def unpartial_placements(spec: DistSpec) -> list[Placement]:
    """Placements with every Partial axis turned into a Shard (Replicate for 0-d tensors).

    Each Partial axis shards the dim with the largest extent still unsplit by the axes
    before it, so the reduction is a reduce-scatter and the stored chunks stay sharded.
    """
    extent = list(spec.shape)
    for p, k in zip(spec.placements, spec.mesh.shape, strict=True):
        if isinstance(p, Shard):
            extent[p.dim] = -(-extent[p.dim] // k)
    out: list[Placement] = []
    for p, k in zip(spec.placements, spec.mesh.shape, strict=True):
        if isinstance(p, Partial):
            if not extent:
                out.append(Replicate())
                continue
            d = max(range(len(extent)), key=lambda i: (extent[i], -i))
            out.append(Shard(d))
            extent[d] = -(-extent[d] // k)
        else:
            out.append(p)
    return out


def split_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut ``box`` into contiguous (row-major) pieces of at most ``limit`` bytes where possible."""
    nbytes = box_numel(box) * itemsize
    if nbytes <= limit or not box:
        return [box]
    shape = box_shape(box)
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None:
        return [box]
    row_bytes = nbytes // shape[d]
    start, stop = box[d]
    if row_bytes <= limit:
        step = max(1, limit // row_bytes)
        return [(*box[:d], (s, min(s + step, stop)), *box[d + 1 :]) for s in range(start, stop, step)]
    out: list[Box] = []
    for s in range(start, stop):
        out.extend(split_box((*box[:d], (s, s + 1), *box[d + 1 :]), itemsize, limit))
    return out


def leaf_cells(leaf: Leaf, world: tuple[int, ...], reference: bool) -> list[tuple[Box, tuple[int, ...]]]:
    """The distinct non-empty boxes of what is stored for ``leaf`` and the ranks holding each."""
    if leaf.kind == "dist" and not reference:
        assert leaf.stored_spec is not None
        cells = leaf.stored_spec.cells.items()
    else:
        cells = [(full_box(leaf.shape), world)]
    return [(box, ranks) for box, ranks in cells if box_numel(box) > 0]


def plan_chunks(
    leaves: list[Leaf], world: tuple[int, ...], reference: bool, piece_bytes: int = PIECE_BYTES
) -> tuple[dict[str, list[Piece]], dict[int, FilePlan]]:
    """Pieces per leaf (in box order) and the file of every writing rank (see the module doc)."""
    load = dict.fromkeys(world, 0)
    pieces: dict[str, list[Piece]] = {}
    for leaf in sorted(leaves, key=lambda lf: lf.name):
        itemsize = leaf.dtype.itemsize
        out: list[Piece] = []
        for cell, ranks in leaf_cells(leaf, world, reference):
            for box in split_box(cell, itemsize, piece_bytes):
                nbytes = box_numel(box) * itemsize
                owner = min(ranks, key=lambda r: (load.get(r, 0), r))
                load[owner] = load.get(owner, 0) + nbytes
                out.append(Piece(leaf.name, len(out), box, cell, owner, nbytes))
        pieces[leaf.name] = out
    files: dict[int, FilePlan] = {}
    for name in sorted(pieces):
        for piece in pieces[name]:
            files.setdefault(piece.owner, FilePlan(piece.owner)).pieces.append(piece)
    itemsizes = {leaf.name: leaf.dtype.itemsize for leaf in leaves}
    for fp in files.values():
        # Largest items first keeps every piece aligned to its itemsize (safetensors does the same).
        fp.pieces.sort(key=lambda p: -itemsizes[p.name])
        offset = 0
        for p in fp.pieces:
            fp.offsets.append((offset, offset + p.nbytes))
            offset += p.nbytes
    return pieces, dict(sorted(files.items()))
