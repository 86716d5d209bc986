"""The whole schema of a checkpoint's ``metadata.json``, checked before the loader uses any of it.

``metadata.json`` may come from someone else. Before a single chunk is read, every field the
loader or ``describe_checkpoint`` touches is checked: types, dtype names (the safetensors
table), shapes (non-negative bounded ints), chunk files (plain names inside the checkpoint
directory, via ``mpipar.untrusted.inside``), chunk keys (one chunk per file and key), checksums
(32-bit ints), byte counts (equal to the box's), and every box: inside the tensor's shape, the
chunks of one tensor disjoint and covering it exactly. A refusal is a ``CheckpointError`` naming
the metadata file, the field (``tensors['w'].chunks[1].box``) and the value.

The cover check paints the chunks on the grid of their distinct cut points (one NumPy slice
assignment per chunk, so thousands of chunks take milliseconds); a layout whose cut grid is
too large for that falls back to a sweep along dim 0.
"""

from __future__ import annotations

import bisect
import math
import os
import stat
from typing import Any

import numpy as np

from mpipar.checkpoint.format import (
    _ST_DTYPES,
    CHECKSUM,
    FORMAT,
    MAX_DIM,
    MAX_METADATA_BYTES,
    METADATA,
    METADATA_INT_DIGITS,
    VERSION,
    CheckpointError,
    describe_missing,
)
from mpipar.placement import placement_problem
from mpipar.untrusted import FileFormatError, inside, parse_json, read_bounded

ARRAY_KINDS = ("dist", "dense", "array", "scalar")
MAX_NDIM = 64
MAX_WORLD = 1 << 24
"""Ranks of a world (and of a mesh) a checkpoint may describe."""
MAX_TENSOR_BYTES = 1 << 56
"""A tensor claiming more bytes than this is refused (no allocation is attempted for it)."""
_GRID_CELLS = 1 << 22
"""The cover check paints a cut grid of at most this many cells; larger ones use the sweep."""
_ITEMSIZE = {name: (2 if name == "bfloat16" else np.dtype(name).itemsize) for name in _ST_DTYPES}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Check:
    def __init__(self, root: str) -> None:
        self.root = root
        self.source = os.path.join(root, METADATA)
        self.checked_names: set[str] = set()
        """File names already found inside ``root`` (thousands of chunks share a few files)."""

    def fail(self, field_path: str, value: Any, problem: str) -> CheckpointError:
        return CheckpointError(field_path=field_path, value=value, problem=problem, source=self.source)

    def int_in(self, field_path: str, value: Any, low: int, high: int) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise self.fail(field_path, value, f"is not an int in [{low}, {high}]")
        return value

    def of_type(self, field_path: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
        if not isinstance(value, kind):
            raise self.fail(field_path, value, f"is not {what}")
        return value


def check_metadata(meta: dict[str, Any], root: str) -> None:
    """Refuse ``meta`` (read from ``root/metadata.json``) unless every field is well formed."""
    c = _Check(root)
    c.int_in("world_size", meta.get("world_size"), 1, MAX_WORLD)
    files = c.of_type("files", meta.get("files"), list, "a list of data file names")
    for i, name in enumerate(files):
        _inside(c, name, f"files[{i}]")
    tensors = c.of_type("tensors", meta.get("tensors"), dict, "an object of tensor entries")
    seen: dict[tuple[str, str], str] = {}
    for name, t in tensors.items():
        _check_tensor(c, name, t, seen)
    _check_structure(c, meta.get("state"), tensors)


def _inside(c: _Check, name: Any, field_path: str) -> None:
    if isinstance(name, str) and name in c.checked_names:
        return
    try:
        inside(c.root, name, kind="checkpoint", field_path=field_path)
    except FileFormatError as exc:
        raise CheckpointError(field_path=field_path, value=name, problem=exc.problem, source=c.source) from None
    c.checked_names.add(name)


def _check_layout(c: _Check, at: str, t: dict[str, Any], tensor_shape: list[int]) -> None:
    """The source layout, checked as ``ProcessMesh`` and ``DistSpec`` check theirs: it is only
    described (the values come from the boxes), but a described layout must be a possible one."""
    mesh = t.get("mesh")
    texts = {key: t.get(key) for key in ("placements", "stored_placements")}
    if mesh is None:
        for key, text in texts.items():
            if text is not None:
                raise c.fail(f"{at}.{key}", text, "is set though the entry has no mesh")
        return
    c.of_type(f"{at}.mesh", mesh, dict, "null or an object")
    shape = c.of_type(f"{at}.mesh.shape", mesh.get("shape"), list, "a list of axis sizes")
    if not 1 <= len(shape) <= MAX_NDIM:
        raise c.fail(f"{at}.mesh.shape", shape, f"does not have 1 to {MAX_NDIM} axes")
    for d, n in enumerate(shape):
        c.int_in(f"{at}.mesh.shape[{d}]", n, 1, MAX_WORLD)
    if math.prod(shape) > MAX_WORLD:
        raise c.fail(f"{at}.mesh.shape", shape, f"makes a mesh of more than {MAX_WORLD} ranks")
    ids = c.of_type(f"{at}.mesh.process_ids", mesh.get("process_ids"), list, "a flat list of ranks")
    if len(ids) != math.prod(shape) or not all(_is_int(r) and 0 <= r < MAX_WORLD for r in ids):
        raise c.fail(
            f"{at}.mesh.process_ids",
            ids,
            f"is not {math.prod(shape)} ranks in [0, {MAX_WORLD}), one per cell of the mesh",
        )
    if len(set(ids)) != len(ids):
        raise c.fail(f"{at}.mesh.process_ids", ids, "repeats a rank")
    names = mesh.get("dim_names")
    if names is not None and not (
        isinstance(names, list)
        and len(names) == len(shape)
        and all(isinstance(n, str) and n for n in names)
        and len(set(names)) == len(names)
    ):
        raise c.fail(f"{at}.mesh.dim_names", names, f"is not {len(shape)} distinct axis names")
    for key, text in texts.items():
        if text is None:
            if key == "placements":
                raise c.fail(f"{at}.placements", text, "is missing though the entry has a mesh")
            continue
        c.of_type(f"{at}.{key}", text, str, "null or a placement string")
        problem = placement_problem(text, len(shape), len(tensor_shape), tensor_shape, shape)
        if problem:
            raise c.fail(f"{at}.{key}", text, problem)


def _check_tensor(c: _Check, name: str, t: Any, seen: dict[tuple[str, str], str]) -> None:
    at = f"tensors[{name!r}]"
    c.of_type(at, t, dict, "an object")
    if t.get("kind") not in ARRAY_KINDS:
        raise c.fail(f"{at}.kind", t.get("kind"), f"is not one of {list(ARRAY_KINDS)}")
    dtype = t.get("dtype")
    if not isinstance(dtype, str) or dtype not in _ITEMSIZE:
        raise c.fail(f"{at}.dtype", dtype, f"is not a dtype a checkpoint stores ({', '.join(sorted(_ITEMSIZE))})")
    shape = c.of_type(f"{at}.shape", t.get("shape"), list, "a list of dimension sizes")
    if len(shape) > MAX_NDIM:
        raise c.fail(f"{at}.shape", shape, f"has more than {MAX_NDIM} dimensions")
    for d, n in enumerate(shape):
        c.int_in(f"{at}.shape[{d}]", n, 0, MAX_DIM)
    if t["kind"] == "scalar" and shape:
        raise c.fail(f"{at}.shape", shape, "is not [] though the entry is a scalar")
    itemsize = _ITEMSIZE[dtype]
    numel = math.prod(shape)
    if numel * itemsize > MAX_TENSOR_BYTES:
        raise c.fail(f"{at}.shape", shape, f"makes a tensor of {numel * itemsize} bytes, over {MAX_TENSOR_BYTES}")
    _check_layout(c, at, t, shape)
    chunks = c.of_type(f"{at}.chunks", t.get("chunks"), list, "a list of chunks")
    boxes: list[tuple[tuple[int, int], ...]] = []
    for i, chunk in enumerate(chunks):
        where = f"{at}.chunks[{i}]"
        c.of_type(where, chunk, dict, "an object")
        fname = chunk.get("file")
        _inside(c, fname, f"{where}.file")
        key = c.of_type(f"{where}.key", chunk.get("key"), str, "a string (the chunk's key in its data file)")
        if (fname, key) in seen:
            raise c.fail(f"{where}.key", key, f"in {fname} is also the key of a chunk of {seen[(fname, key)]}")
        seen[(fname, key)] = f"{at}.chunks[{i}]"
        raw = c.of_type(f"{where}.box", chunk.get("box"), list, "a list of [start, stop] pairs")
        if len(raw) != len(shape):
            raise c.fail(f"{where}.box", raw, f"has {len(raw)} ranges for a tensor of {len(shape)} dimensions")
        box = []
        for d, (r, n) in enumerate(zip(raw, shape, strict=True)):
            if not (isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and 0 <= r[0] <= r[1] <= n):
                raise c.fail(f"{where}.box[{d}]", r, f"is not a range [start, stop] with 0 <= start <= stop <= {n}")
            box.append((r[0], r[1]))
        boxes.append(tuple(box))
        want = math.prod(e - s for s, e in box) * itemsize
        if not _is_int(chunk.get("nbytes")) or chunk["nbytes"] != want:
            raise c.fail(f"{where}.nbytes", chunk.get("nbytes"), f"is not {want}, the bytes of its box")
        c.int_in(f"{where}.crc32c", chunk.get("crc32c"), 0, (1 << 32) - 1)
    _check_cover(c, at, shape, boxes)


def _flat(value: Any) -> list[Any]:
    out: list[Any] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        else:
            out.append(v)
    return out


def _check_cover(c: _Check, at: str, shape: list[int], boxes: list[tuple[tuple[int, int], ...]]) -> None:
    """The boxes (each already inside ``shape``) are disjoint and cover it exactly."""
    numel = math.prod(shape)
    volume = sum(math.prod(e - s for s, e in b) for b in boxes)
    if volume != numel:
        raise c.fail(
            f"{at}.chunks",
            f"{len(boxes)} chunks",
            f"hold {volume} elements, but the tensor of shape {shape} has {numel}: chunks are missing or overlap",
        )
    solid = [(i, b) for i, b in enumerate(boxes) if all(e > s for s, e in b)]
    if not shape:
        if len(solid) > 1:
            raise c.fail(f"{at}.chunks", f"{len(solid)} chunks", "all hold the one value of a 0-d tensor")
        return
    cuts = [sorted({p for _, b in solid for p in b[d]}) for d in range(len(shape))]
    cells = math.prod(max(len(x) - 1, 0) for x in cuts)
    if cells <= _GRID_CELLS:
        index = [{p: k for k, p in enumerate(x)} for x in cuts]
        owner = np.full([max(len(x) - 1, 0) for x in cuts], -1, dtype=np.int32)
        for i, b in solid:
            sl = tuple(slice(index[d][s], index[d][e]) for d, (s, e) in enumerate(b))
            region = owner[sl]
            if (region >= 0).any():
                j = int(region[region >= 0].flat[0])
                raise _overlap(c, at, j, i, boxes)
            owner[sl] = i
        return
    budget = [_SWEEP_WORK + 8 * len(solid)]
    pair = _find_overlap(solid, 0, len(shape), budget)
    if pair is None and budget[0] < 0:
        raise c.fail(
            f"{at}.chunks",
            f"{len(boxes)} chunks",
            f"are laid out too irregularly to verify within the work bound ({_SWEEP_WORK} steps); "
            "mpipar's saves write a grid of boxes cut into slabs, which is verified in linear time",
        )
    if pair is not None:
        raise _overlap(c, at, pair[0], pair[1], boxes)


def _sweep_planes(
    items: list[tuple[int, tuple[tuple[int, int], ...]]], d: int, budget: list[int]
) -> tuple[int, int] | None:
    """``_find_overlap`` over the last two dims: sweep dim ``d`` keeping the intervals on the
    last dim of the boxes present sorted (they are disjoint), so each entering box is checked
    against its two neighbours only: O(n log n) comparisons however the boxes are laid out."""
    events = sorted(
        [(b[d][1], 0, i, b) for i, b in items] + [(b[d][0], 1, i, b) for i, b in items],
        key=lambda ev: (ev[0], ev[1]),
    )  # at one position, leaving before entering: boxes that only touch do not overlap
    starts: list[int] = []
    present: list[tuple[int, int, int]] = []  # (start, stop, box index) on the last dim, by start
    for _, entering, i, b in events:
        budget[0] -= 1
        s, e = b[d + 1]
        k = bisect.bisect_left(starts, s)
        if not entering:
            while present[k][2] != i:  # equal starts cannot happen among disjoint solid intervals
                k += 1
            del starts[k], present[k]
            continue
        if k < len(present) and present[k][0] < e:
            return present[k][2], i
        if k > 0 and present[k - 1][1] > s:
            return present[k - 1][2], i
        starts.insert(k, s)
        present.insert(k, (s, e, i))
    return None


_SWEEP_WORK = 1 << 22
"""Work bound of the sweep that verifies irregular chunk layouts (a grid of at most
``_GRID_CELLS`` cut cells, which every layout mpipar writes gives, is painted instead)."""


def _find_overlap(
    items: list[tuple[int, tuple[tuple[int, int], ...]]], d: int, ndim: int, budget: list[int]
) -> tuple[int, int] | None:
    """Two overlapping boxes among ``items`` (all overlapping in dims before ``d``), or None.

    Sort and sweep along dim ``d``: boxes enter at their start and leave at their end; only an
    entry can create an overlap, so the boxes still present are checked again (on the next
    dims) only after boxes enter. The last dim is one sort and one pass. ``budget`` counts the
    work; once spent, the search stops (the caller refuses the file).
    """
    budget[0] -= len(items)
    if budget[0] < 0:
        return None
    if d == ndim - 1:
        reach, holder = None, -1
        for i, b in sorted(items, key=lambda ib: ib[1][d][0]):
            s, e = b[d]
            if reach is not None and s < reach:
                return holder, i
            if reach is None or e > reach:
                reach, holder = e, i
        return None
    if d == ndim - 2:
        return _sweep_planes(items, d, budget)
    starts: dict[int, list[tuple[int, tuple[tuple[int, int], ...]]]] = {}
    ends: dict[int, list[int]] = {}
    for i, b in items:
        starts.setdefault(b[d][0], []).append((i, b))
        ends.setdefault(b[d][1], []).append(i)
    active: dict[int, tuple[tuple[int, int], ...]] = {}
    for p in sorted(starts.keys() | ends.keys()):
        for i in ends.get(p, ()):
            active.pop(i, None)
        entering = starts.get(p)
        if entering:
            active.update(entering)
            if len(active) > 1:
                pair = _find_overlap(list(active.items()), d + 1, ndim, budget)
                if pair is not None or budget[0] < 0:
                    return pair
    return None


def _overlap(c: _Check, at: str, j: int, i: int, boxes: list[tuple[tuple[int, int], ...]]) -> CheckpointError:
    a, b = sorted((i, j))
    return c.fail(
        f"{at}.chunks[{b}].box",
        [list(r) for r in boxes[b]],
        f"overlaps chunks[{a}].box {[list(r) for r in boxes[a]]}: a tensor's chunks must be disjoint",
    )


_PLAIN = (type(None), bool, int, float, str)


def _check_structure(c: _Check, state: Any, tensors: dict[str, Any]) -> None:
    """Every node of the saved state's structure has one known kind and well-typed contents."""
    if not isinstance(state, dict) or "dict" not in state:
        raise c.fail("state", state if not isinstance(state, dict) else list(state), "is not a {'dict': ...} node")
    stack: list[tuple[Any, str]] = [(state, "state")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict) or len(node) != 1:
            raise c.fail(where, node, "is not a structure node (an object with one key)")
        kind, value = next(iter(node.items()))
        if kind in ARRAY_KINDS:
            if not isinstance(value, str) or value not in tensors:
                raise c.fail(f"{where}.{kind}", value, "names no tensor of the checkpoint's 'tensors'")
            if tensors[value]["kind"] != kind:
                raise c.fail(f"{where}.{kind}", value, f"is a {tensors[value]['kind']} entry in 'tensors', not {kind}")
        elif kind == "dict":
            c.of_type(f"{where}.dict", value, list, "a list of [key, node] pairs")
            for k, item in enumerate(value):
                if not (
                    isinstance(item, list)
                    and len(item) == 2
                    and isinstance(item[0], str | int)
                    and not isinstance(item[0], bool)
                ):
                    raise c.fail(f"{where}.dict[{k}]", item, "is not a [key, node] pair with a str or int key")
                stack.append((item[1], f"{where}[{item[0]!r}]"))
        elif kind in ("list", "tuple"):
            c.of_type(f"{where}.{kind}", value, list, "a list of nodes")
            stack.extend((item, f"{where}[{k}]") for k, item in enumerate(value))
        elif kind == "value":
            c.of_type(f"{where}.value", value, _PLAIN, "null, a bool, a number or a string")
        elif kind == "float":
            if value not in ("nan", "inf", "-inf"):
                raise c.fail(f"{where}.float", value, "is not 'nan', 'inf' or '-inf'")
        else:
            raise c.fail(where, kind, "is not a known structure node kind")


def load_metadata(path: str) -> dict[str, Any]:
    """Read and check ``path/metadata.json`` as untrusted input; a missing one explains what the directory is.

    The file is read through ``mpipar.untrusted`` (a regular file only, size and depth capped,
    numbers bounded) and its whole schema is validated (``validate.check_metadata``) before
    anything uses it: every refusal is a ``CheckpointError`` naming the file, field and value.
    """
    meta_path = os.path.join(path, METADATA)
    try:
        mode = os.stat(meta_path).st_mode
    except FileNotFoundError:
        raise CheckpointError(describe_missing(path)) from None
    except OSError as exc:
        raise CheckpointError(
            field_path="<file>", value=meta_path, problem=f"cannot be read ({exc.strerror})", source=meta_path
        ) from None
    if stat.S_ISDIR(mode):
        raise CheckpointError(
            field_path="<file>", value=meta_path, problem="is a directory, not a metadata file", source=meta_path
        )
    try:
        # A metadata.json that is a symlink out of the directory is not read.
        inside(path, METADATA, kind="checkpoint", field_path="<file>")
        meta = parse_json(
            read_bounded(meta_path, kind="checkpoint", max_bytes=MAX_METADATA_BYTES),
            kind="checkpoint",
            source=meta_path,
            max_bytes=MAX_METADATA_BYTES,
            max_int_digits=METADATA_INT_DIGITS,
        )
    except FileFormatError as exc:
        raise CheckpointError.of(exc) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not an mpipar checkpoint metadata file (format {FORMAT!r} expected)")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {meta.get('version')!r}; this mpipar reads version {VERSION}"
        )
    if meta.get("checksum") != CHECKSUM:
        raise CheckpointError(f"checkpoint {path} uses checksum {meta.get('checksum')!r}; expected {CHECKSUM!r}")
    check_metadata(meta, path)
    return meta
