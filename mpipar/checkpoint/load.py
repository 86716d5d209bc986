"""``load_state_dict``: fill tensors in place from a checkpoint saved under any layout.

The target tensors may sit on other meshes, in a world of another size, with other
placements (Partial included), or be dense. Each process works out the boxes its hosted ranks
hold, reads only the stored chunks overlapping them (a chunk that lands contiguously in a
shard is read straight into it by a positioned read of exactly its bytes; one cut into several
shards is copied into them out of a read-only memory map of its file), verifies every chunk's
CRC-32C, and installs the new shards. (Like every reader that maps files, a data file
truncated by someone else *while* it is being loaded ends the process with SIGBUS; a file
truncated before is refused by its header check.) No communication moves tensor data; the one
collective is the final error agreement, so every rank raises when any rank fails.

Errors name the tensor and file at fault: a missing entry, a shape or dtype mismatch, a
missing or truncated data file, a checksum mismatch, an interrupted save.
"""

from __future__ import annotations

import mmap
import os
import stat
from concurrent.futures import Future
from typing import Any

import numpy as np

from mpipar._modes import Mode, execution_mode
from mpipar.backend import current_backend
from mpipar.checkpoint.coord import Coordinator
from mpipar.checkpoint.format import (
    CHECKSUM,
    METADATA,
    CheckpointError,
    FileEntry,
    byte_view,
    checksum,
    checksum_async,
    numpy_dtype,
    open_data_file,
    read_header,
    read_into,
    st_dtype,
)
from mpipar.checkpoint.layout import decode_value, path_name
from mpipar.checkpoint.save import remove_commit_leftovers
from mpipar.checkpoint.stats import ChunkRead, note_open, note_read
from mpipar.checkpoint.validate import load_metadata
from mpipar.reshard.executor import execute_plan
from mpipar.reshard.planner import plan_reshard
from mpipar.spec import Box, box_intersect, box_numel, box_relative, box_shape, full_box
from mpipar.tensor import Tensor
from mpipar.untrusted import printable

_KEEP = object()
"""``_Loader.walk`` result: the given object was filled in place (nothing to replace)."""
_ARRAY_KINDS = ("dist", "dense", "array", "scalar")


def load_state_dict(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """Fill ``state_dict`` from the checkpoint at ``path`` (a collective: every process calls it).

    Tensors (dense or distributed, any mesh and placements) and writeable NumPy arrays are
    filled in place; they must have the saved shape and dtype. Other entries (ints, floats,
    strings, lists, read-only arrays, tuples) are replaced in their dict or list by the saved
    values. Only the keys present in ``state_dict`` are loaded; each must exist in the
    checkpoint. Returns ``state_dict``. On an error, tensors filled before it keep their new
    values.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict fills a dict of names to tensors and values, got {type(state_dict).__name__}")
    backend = current_backend()
    root = os.path.abspath(os.fspath(path))
    coord = Coordinator(backend, f"checkpoint load from {root}")
    error: BaseException | None = None
    loader: _Loader | None = None
    try:
        meta = load_metadata(root)
        loader = _Loader(root, meta)
        loader.walk(state_dict, meta["state"], ())
    except Exception as exc:
        error = exc
    finally:
        if loader is not None:
            loader.close()
    coord.raise_if_failed(error, f"checkpoint load from {root}")
    if coord.is_leader:
        # A save killed between its two renames left the previous checkpoint beside this one.
        remove_commit_leftovers(root)
    return state_dict


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole saved state as plain values: every tensor as a dense NumPy array (not collective)."""
    root = os.path.abspath(os.fspath(path))
    meta = load_metadata(root)
    loader = _Loader(root, meta)
    try:
        return loader.decode(meta["state"], ())
    finally:
        loader.close()


def describe_checkpoint(path: str | os.PathLike[str]) -> str:
    """A text table of a checkpoint's tensors, layouts and chunks.

    Every name from the file (tensor names, chunk keys, file names, the path) goes through
    ``printable``: a name cannot clear the terminal, retitle it, or forge a line of the table.
    """
    root = os.fspath(path)
    meta = load_metadata(root)
    p = printable
    lines = [f"checkpoint {p(root)}: {len(meta['files'])} data file(s), saved by a world of {meta['world_size']}"]
    for name, t in meta["tensors"].items():
        where = (
            f" on {t['mesh']['shape']} mesh {_ids_text(t['mesh']['process_ids'])} {p(t['placements'])}"
            if t["mesh"]
            else ""
        )
        lines.append(f"  {p(name)} {t['dtype']}{t['shape']} ({t['kind']}){where}")
        for c in t["chunks"]:
            box = "x".join(f"[{s},{e})" for s, e in c["box"]) or "()"
            lines.append(f"    {p(c['key']):<24} {box:<24} {p(c['file'])} {c['nbytes']} B")
    return "\n".join(lines)


_IDS_SHOWN = 64


def _ids_text(ids: list[int]) -> str:
    """A mesh's process ids, cut after ``_IDS_SHOWN`` (a 2^24-rank mesh is 16M ids per line)."""
    if len(ids) <= _IDS_SHOWN:
        return str(ids)
    return f"{str(ids[:_IDS_SHOWN])[:-1]}, ... ({len(ids)} ranks)]"


class _Loader:
    """Reads chunks of one checkpoint for this process; keeps its data files open until closed."""

    def __init__(self, root: str, meta: dict[str, Any]) -> None:
        self.root = root
        self.meta = meta
        self.backend = current_backend()
        self._files: dict[str, tuple[Any, int, dict[str, FileEntry]]] = {}
        self._buffer = np.empty(0, dtype=np.uint8)
        self._maps: dict[str, mmap.mmap] = {}
        self._pending: list[tuple[Future[int], str, dict[str, Any], Box, str]] = []

    def close(self) -> None:
        for pending, *_ in self._pending:
            pending.result()  # no worker may still read a buffer once the load returns
        self._pending.clear()
        for mapped in self._maps.values():
            mapped.close()
        self._maps.clear()
        for f, _, _ in self._files.values():
            f.close()
        self._files.clear()

    # ------------------------------------------------------------------ structure
    def walk(self, given: Any, node: dict[str, Any], path: tuple[Any, ...]) -> Any:
        """Fill ``given`` from ``node``; return ``_KEEP`` or the value to put in its place."""
        if isinstance(given, Tensor):
            self._fill_tensor(given, path_name(path), self._entry(node, path, "a Tensor"))
            return _KEEP
        if isinstance(given, np.ndarray):
            name = path_name(path)
            entry = self._entry(node, path, "a NumPy array")
            self._check_match(name, entry, given.shape, given.dtype, "array")
            value = self._read_full(name, entry)
            if given.flags.writeable:
                np.copyto(given, value)
                return _KEEP
            return value
        if isinstance(given, dict):
            if "dict" not in node:
                raise self._kind_error(node, path, "a dict")
            stored = {k: v for k, v in node["dict"]}
            for key in list(given):
                if key not in stored:
                    avail = ", ".join(repr(k) for k in stored) or "nothing"
                    raise CheckpointError(
                        f"checkpoint {self.root} has no entry {path_name((*path, key))!r} (see its {METADATA}); "
                        f"under {path_name(path)!r} it holds {avail}"
                    )
                out = self.walk(given[key], stored[key], (*path, key))
                if out is not _KEEP:
                    given[key] = out
            return _KEEP
        if isinstance(given, (list, tuple)):
            items = node.get("list", node.get("tuple"))
            if items is not None and len(items) == len(given):
                outs = [self.walk(g, n, (*path, i)) for i, (g, n) in enumerate(zip(given, items, strict=True))]
                if isinstance(given, list):
                    for i, out in enumerate(outs):
                        if out is not _KEEP:
                            given[i] = out
                    return _KEEP
                values = [g if o is _KEEP else o for g, o in zip(given, outs, strict=True)]
                return type(given)(*values) if hasattr(given, "_fields") else type(given)(values)
            if _holds_tensor(given):
                have = f"{len(items)} entries" if items is not None else f"a {next(iter(node))}"
                raise CheckpointError(
                    f"state entry {path_name(path)!r} has {len(given)} entries holding tensors, but checkpoint "
                    f"{self.root} has {have} there"
                )
        return self.decode(node, path)

    def decode(self, node: dict[str, Any], path: tuple[Any, ...]) -> Any:
        """A structure node as plain values, arrays read whole."""
        kind = next(iter(node))
        if kind in _ARRAY_KINDS:
            name = node[kind]
            value = self._read_full(name, self._tensor_meta(name))
            return value[()] if kind == "scalar" else value
        if kind == "dict":
            return {k: self.decode(v, (*path, k)) for k, v in node["dict"]}
        if kind in ("list", "tuple"):
            values = [self.decode(v, (*path, i)) for i, v in enumerate(node[kind])]
            return values if kind == "list" else tuple(values)
        return decode_value(node)

    def _entry(self, node: dict[str, Any], path: tuple[Any, ...], given: str) -> dict[str, Any]:
        kind = next(iter(node))
        if kind not in _ARRAY_KINDS:
            raise self._kind_error(node, path, given)
        return self._tensor_meta(node[kind])

    def _tensor_meta(self, name: str) -> dict[str, Any]:
        try:
            return self.meta["tensors"][name]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.root}: {METADATA} names tensor {name!r} but has no entry for it"
            ) from None

    def _kind_error(self, node: dict[str, Any], path: tuple[Any, ...], given: str) -> CheckpointError:
        kind = next(iter(node))
        saved = {
            "dist": "a distributed tensor",
            "dense": "a dense tensor",
            "array": "a NumPy array",
            "scalar": "a NumPy scalar",
            "dict": "a dict",
            "list": "a list",
            "tuple": "a tuple",
        }.get(kind, "a value")
        return CheckpointError(
            f"state entry {path_name(path)!r} is {given}, but checkpoint {self.root} holds {saved} there"
        )

    def _check_match(self, name: str, entry: dict[str, Any], shape: Any, dtype: np.dtype, what: str) -> None:
        if tuple(entry["shape"]) != tuple(shape):
            raise CheckpointError(
                f"{what} {name!r} has shape {list(shape)}, but checkpoint {self.root} ({METADATA}) holds "
                f"shape {entry['shape']}; build it with the saved shape"
            )
        if entry["dtype"] != np.dtype(dtype).name:
            raise CheckpointError(
                f"{what} {name!r} has dtype {np.dtype(dtype)}, but checkpoint {self.root} ({METADATA}) holds "
                f"{entry['dtype']}; build it with dtype {entry['dtype']} (and cast after loading if needed)"
            )

    # ------------------------------------------------------------------ tensors
    def _fill_tensor(self, t: Tensor, name: str, entry: dict[str, Any]) -> None:
        self._check_match(name, entry, t.shape, t.dtype, "tensor")
        dtype = numpy_dtype(entry["dtype"])
        backend = self.backend
        if not t.is_dist:
            value = self._read_full(name, entry)
            t._take_storage(Tensor._dense_output(_frozen(value)))
            return
        spec = t.spec
        if execution_mode((), backend) is Mode.DENSE:
            t._take_storage(Tensor._from_reference(spec, _frozen(self._read_full(name, entry))))
            return
        filled = spec.without_partial()
        ranks = backend.hosted_ranks(spec.mesh)
        boxes = {r: filled.boxes[r] for r in ranks}
        # The global boxes each rank reads: its box, or the chunks of a zigzag split it holds.
        pieces = {r: filled.global_pieces(box) if filled.zigzag else [((...,), box)] for r, box in boxes.items()}
        dests: dict[Box, np.ndarray] = {}
        owners: dict[Box, list[int]] = {}
        for r, held in pieces.items():
            for _, box in held:
                if box not in dests:
                    dests[box] = np.empty(box_shape(box), dtype)
                owners.setdefault(box, []).append(r)
        self._fill(name, entry, dests, owners)
        shards: dict[int, Any] = {r: _frozen(_joined(boxes[r], pieces[r], dests, dtype)) for r in ranks}
        if filled != spec:
            # Replicate -> Partial is local (the first rank of each Partial axis keeps the value).
            shards = execute_plan(plan_reshard(filled, spec), shards, dtype, backend)
        if backend.xp is not np:
            shards = {r: backend.xp.asarray(a) for r, a in shards.items()}
        t._set_dist(spec, shards, dtype)

    def _read_full(self, name: str, entry: dict[str, Any]) -> np.ndarray:
        box = full_box(entry["shape"])
        _check_data_present(self.root, name, entry)
        out = np.empty(box_shape(box), numpy_dtype(entry["dtype"]))
        backend = self.backend
        self._fill(name, entry, {box: out}, {box: [r for r in backend.world_group() if backend.hosts(r)]})
        return out

    def _fill(
        self, name: str, entry: dict[str, Any], dests: dict[Box, np.ndarray], owners: dict[Box, list[int]]
    ) -> None:
        """Fill every destination box from the stored chunks overlapping it (each chunk read once)."""
        chunks = entry["chunks"]
        stored = sum(box_numel(_box(c["box"])) for c in chunks)
        if stored != box_numel(full_box(entry["shape"])):
            raise CheckpointError(
                f"tensor {name!r}: the chunks in {self.root}/{METADATA} hold {stored} elements, the tensor "
                f"{box_numel(full_box(entry['shape']))}; the metadata is corrupted"
            )
        dtype = numpy_dtype(entry["dtype"])
        for chunk in chunks:
            cbox = _box(chunk["box"])
            targets = [(b, i) for b in dests if (i := box_intersect(b, cbox)) is not None]
            if not targets:
                continue
            ranks = tuple(sorted(r for b, _ in targets for r in owners[b]))
            # A chunk inside one shard, contiguous there, is read straight into it (no copy).
            data, direct = None, None
            for b, inter in targets:
                if inter == cbox:
                    view = dests[b][box_relative(cbox, b)]
                    if view.flags.c_contiguous:
                        data, direct = self._read_chunk(name, chunk, cbox, dtype, view, ranks, defer=True), b
                        break
            if data is None and cbox:
                self._read_scattered(name, chunk, cbox, dtype, [(dests[b], b) for b, _ in targets], ranks)
                continue
            if data is None:
                data = self._read_chunk(name, chunk, cbox, dtype, self._scratch(cbox, dtype), ranks)
            for b, inter in targets:
                if b != direct:
                    dests[b][box_relative(inter, b)] = data[box_relative(inter, cbox)]
        self._verify()

    def _read_scattered(
        self,
        name: str,
        chunk: dict[str, Any],
        cbox: Box,
        dtype: np.dtype,
        targets: list[tuple[np.ndarray, Box]],
        ranks: tuple[int, ...],
    ) -> None:
        """Copy a chunk that no shard holds contiguously straight out of the page cache: the
        data file is memory-mapped and the worker thread checksums the chunk's bytes while they
        are copied into the overlapping shards -- one copy, where reading the chunk into a
        buffer first makes two. The shards are installed only after the checksum matches."""
        nbytes = box_numel(cbox) * dtype.itemsize
        f, offset, fpath = self._locate(name, chunk, cbox, dtype, nbytes)
        raw = memoryview(self._map(chunk["file"], f))[offset : offset + nbytes]
        try:
            pending = checksum_async(raw)
            data = np.frombuffer(raw, dtype=dtype).reshape(box_shape(cbox))
            try:
                for dest, b in targets:
                    inter = box_intersect(b, cbox)
                    assert inter is not None
                    dest[box_relative(inter, b)] = data[box_relative(inter, cbox)]
            finally:
                del data
                crc = pending.result()  # the worker is done with the mapping
        finally:
            raw.release()
        note_read(ChunkRead(name, chunk["file"], chunk["key"], cbox, nbytes, ranks))
        self._check(crc, name, chunk, cbox, fpath)

    def _map(self, fname: str, f: Any) -> mmap.mmap:
        mapped = self._maps.get(fname)
        if mapped is None:
            # Read-only and shared: pages come from the page cache, nothing is copied by mapping.
            mapped = self._maps[fname] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return mapped

    def _scratch(self, box: Box, dtype: np.dtype) -> np.ndarray:
        """A reused buffer for a chunk that is cut into several shards (fresh pages cost page faults)."""
        nbytes = box_numel(box) * dtype.itemsize
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes].view(dtype).reshape(box_shape(box))

    def _read_chunk(
        self,
        name: str,
        chunk: dict[str, Any],
        cbox: Box,
        dtype: np.dtype,
        out: np.ndarray,
        ranks: tuple[int, ...],
        defer: bool = False,
    ) -> np.ndarray:
        f, offset, fpath = self._locate(name, chunk, cbox, dtype, out.nbytes)
        read_into(f, offset, out)
        note_read(ChunkRead(name, chunk["file"], chunk["key"], cbox, out.nbytes, ranks))
        if defer:
            # Verified by _verify before the tensor is installed; the next chunk is read meanwhile.
            self._pending.append((checksum_async(byte_view(out)), name, chunk, cbox, fpath))
            if len(self._pending) > 2:
                self._verify(keep=2)
        else:
            self._check(checksum(byte_view(out)), name, chunk, cbox, fpath)
        return out

    def _locate(
        self, name: str, chunk: dict[str, Any], cbox: Box, dtype: np.dtype, nbytes: int
    ) -> tuple[Any, int, str]:
        """The open data file holding ``chunk``, the chunk's byte offset in it, and its path."""
        fname, key = chunk["file"], chunk["key"]
        fpath = os.path.join(self.root, fname)
        f, data_start, entries = self._open(name, fname)
        e = entries.get(key)
        if e is None:
            raise CheckpointError(
                f"tensor {name!r}: data file {fpath} has no chunk {key!r}, which {METADATA} lists; the file is "
                "from another checkpoint or corrupted"
            )
        if e.shape != box_shape(cbox) or e.dtype != st_dtype(dtype, name) or e.stop - e.start != nbytes:
            raise CheckpointError(
                f"tensor {name!r}: chunk {key!r} in data file {fpath} is {e.dtype}{list(e.shape)} "
                f"({e.stop - e.start} B), but {METADATA} expects {st_dtype(dtype, name)}{list(box_shape(cbox))}; "
                "the file is from another checkpoint or corrupted"
            )
        if e.box is not None and e.box != cbox:
            raise CheckpointError(
                f"tensor {name!r}: chunk {key!r} in data file {fpath} holds box {[list(r) for r in e.box]}, but "
                f"{METADATA} places it at {[list(r) for r in cbox]}; the metadata is corrupted (refused)"
            )
        return f, data_start + e.start, fpath

    def _verify(self, keep: int = 0) -> None:
        """Wait for deferred checksums (all but the newest ``keep``) and check them."""
        while len(self._pending) > keep:
            pending, name, chunk, cbox, fpath = self._pending.pop(0)
            self._check(pending.result(), name, chunk, cbox, fpath)

    @staticmethod
    def _check(got: int, name: str, chunk: dict[str, Any], cbox: Box, fpath: str) -> None:
        if got != chunk[CHECKSUM]:
            raise CheckpointError(
                f"checksum mismatch in tensor {name!r}, chunk {chunk['key']!r} (box {[list(r) for r in cbox]}) of "
                f"data file {fpath}: {CHECKSUM} {got:#010x} != {chunk[CHECKSUM]:#010x} recorded at save time; the "
                "file is corrupted (refused). Restore it from a copy or load another checkpoint"
            )

    def _open(self, name: str, fname: str) -> tuple[Any, int, dict[str, FileEntry]]:
        got = self._files.get(fname)
        if got is not None:
            return got
        fpath = os.path.join(self.root, fname)
        try:
            # Validated by check_metadata: a plain name whose resolved path lies inside root.
            f = open_data_file(fpath)  # kept open across chunks, closed by close()
        except CheckpointError:
            if not os.path.lexists(fpath):
                raise CheckpointError(f"tensor {name!r}: data file {fpath}, listed in {METADATA}, is missing") from None
            raise
        try:
            data_start, entries = read_header(f, fpath)
        except BaseException:
            f.close()
            raise
        note_open(fname, data_start)
        self._files[fname] = (f, data_start, entries)
        return self._files[fname]


def _check_data_present(root: str, name: str, entry: dict[str, Any]) -> None:
    """Before a whole tensor's buffer (sized from the metadata) is allocated: each data file
    holds at least the bytes the tensor's chunks claim there, so a forged shape cannot make the
    loader allocate terabytes for data that is not there (refused with the file and both sizes)."""
    claimed: dict[str, int] = {}
    for c in entry["chunks"]:
        claimed[c["file"]] = claimed.get(c["file"], 0) + c["nbytes"]
    for fname, nbytes in claimed.items():
        path = os.path.join(root, fname)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"tensor {name!r}: data file {path}, listed in {METADATA}, is missing") from None
        except OSError as exc:
            raise CheckpointError(
                field_path="files", value=fname, problem=f"cannot be read ({exc.strerror})", source=path
            ) from None
        if not stat.S_ISREG(info.st_mode):
            continue  # the reader refuses it by kind (a FIFO, a directory)
        size = info.st_size
        if size < nbytes:
            raise CheckpointError(
                f"tensor {name!r}: data file {path} has {size} bytes, but the chunks metadata.json puts in it "
                f"take {nbytes}: "
                "the file is truncated or the metadata claims data that is not there"
            )


def _box(raw: list[list[int]]) -> Box:
    return tuple((int(s), int(e)) for s, e in raw)


def _joined(box: Box, pieces: list[tuple[Any, Box]], dests: dict[Box, np.ndarray], dtype: np.dtype) -> np.ndarray:
    """A rank's storage box from the global boxes it read (one piece: that array itself)."""
    if len(pieces) == 1:
        return dests[pieces[0][1]]
    out = np.empty(box_shape(box), dtype)
    for index, gbox in pieces:
        out[index] = dests[gbox]
    return out


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (Tensor, np.ndarray)):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False
