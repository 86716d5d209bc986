"""The on-disk formats of a checkpoint: safetensors data files, the checksum, the metadata JSON.

A checkpoint is a directory::

    P/metadata.json            written last: tensors, chunks, checksums, the state's structure
    P/rank00000.safetensors    the chunks rank 0 owns (one file per writing rank)
    P/rank00003.safetensors    ...

Data files are plain safetensors (8-byte little-endian header length, a JSON header, then the
raw little-endian bytes of every tensor back to back), written by this module so that each
chunk goes from its array's buffer to the file without a copy and is fsynced on the same file
descriptor; ``safetensors.numpy.load_file`` reads them. Chunks are read back by positioned
reads of exactly their byte range, never by loading a whole file. No pickle anywhere: headers
and metadata are JSON, data is raw bytes.

The checksum is CRC-32C (Castagnoli), computed with the ``crc32c`` package's hardware path
(SSE4.2 / ARMv8 CRC instructions): several times faster than ``zlib.crc32``, and it releases the GIL, so it runs on a worker thread while the next chunk is
written or read (``checksum_async``); verifying every byte costs little next to the I/O. Its polynomial
detects every burst error up to 32 bits and every error of 1 to 3 bits in a chunk of up to
256 MiB (Hamming distance 4; chunks are at most 16 MiB by default).
It is the checksum iSCSI, ext4 and Btrfs metadata use. A checksum guards against corruption,
not against an adversary; that would need a cryptographic hash at several times the cost.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numpy as np

from mpipar.untrusted import MEMORY_FACTOR, FileFormatError, open_regular, parse_json

FORMAT = "mpipar.checkpoint"
VERSION = 1
METADATA = "metadata.json"
CHECKSUM = "crc32c"
PARTIAL_TAG = ".partial-"
"""A save writes into the sibling ``P.partial-<token>`` and renames it to ``P`` when complete."""
REPLACED_TAG = ".replaced-"
"""When ``P`` already holds a checkpoint it is moved to ``P.replaced-<token>`` for the swap."""
MARKER = ".mpipar-checkpoint"
"""The first file a save writes into its temporary directory (it stays in the checkpoint):
cleanup and pruning remove only directories that carry it (or, for checkpoints written before
it existed, a complete mpipar ``metadata.json``), never a folder someone else made."""
MARKER_TEXT = b"mpipar.checkpoint: written by mpipar's save_state_dict; cleanup may remove this folder\n"
LOCK_SUFFIX = ".mpipar-lock"
"""A save to ``P`` holds an exclusive ``flock`` on the file ``.<name of P>.mpipar-lock`` beside it
from its temporary directory's creation to its final rename (then removes it): a second save to
the same path is refused by name, and a lock whose holder died is released by the kernel with it."""

_HEADER_ALIGN = 8

_ST_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "bfloat16": "BF16",  # ml_dtypes' bfloat16, when a script uses it
}
_ST_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "U32": 4,
    "I32": 4,
    "U64": 8,
    "I64": 8,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "C64": 8,
}


class CheckpointError(FileFormatError):
    """A checkpoint on disk is incomplete, corrupted or does not match what is asked of it.

    Raised either with a whole message (``CheckpointError("...")``, the loader's checks that
    compare a checkpoint with the state asked of it) or, for a malformed file, with the
    ``FileFormatError`` parts: ``field_path`` (``tensors['w'].chunks[1].box``), ``value``,
    ``problem`` and ``source`` (the file), so the message names all of them.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        field_path: str = "<file>",
        value: Any = None,
        problem: str = "",
        source: str | None = None,
    ) -> None:
        if message is None:
            super().__init__("checkpoint", field_path, value, problem, source)
            return
        ValueError.__init__(self, message)
        self.kind = "checkpoint"
        self.field = field_path
        self.value = value
        self.problem = problem or message
        self.source = source

    @classmethod
    def of(cls, exc: FileFormatError) -> CheckpointError:
        """The same refusal as a ``CheckpointError`` (what callers of the checkpoint API catch)."""
        if isinstance(exc, CheckpointError):
            return exc
        return cls(field_path=exc.field, value=exc.value, problem=exc.problem, source=exc.source)


def checksum(data: Any, value: int = 0) -> int:
    """CRC-32C of a bytes-like object (continuing from ``value``)."""
    return int(_crc32c.crc32c(data, value))


_pools: dict[str, ThreadPoolExecutor] = {}


def worker(name: str) -> ThreadPoolExecutor:
    """A one-thread executor (tasks run in submission order): ``crc32c`` or ``fsync``."""
    pool = _pools.get(name)
    if pool is None:
        pool = _pools[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mpipar-{name}")
    return pool


def checksum_async(data: Any, value: int = 0) -> Future[int]:
    """``checksum`` on a worker thread: the CRC releases the GIL, so it overlaps the next read
    or write instead of adding to it. The caller keeps ``data`` unchanged until the result."""
    return worker("crc32c").submit(checksum, data, value)


def st_dtype(dtype: np.dtype, what: str) -> str:
    """The safetensors dtype code of a NumPy dtype, or a TypeError naming ``what``."""
    code = _ST_DTYPES.get(np.dtype(dtype).name)
    if code is None:
        raise TypeError(
            f"{what} has dtype {np.dtype(dtype)}, which safetensors cannot store; supported: "
            f"{', '.join(sorted(_ST_DTYPES))}. Convert it (e.g. complex128 -> a float64 array of "
            "shape (..., 2) with .view(np.float64)) before saving"
        )
    return code


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype recorded by name in the metadata (``bfloat16`` needs ml_dtypes)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise CheckpointError(
                "this checkpoint stores bfloat16 tensors, and NumPy has no bfloat16 of its own: "
                "install ml_dtypes (pip install ml_dtypes) to load it"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def as_le_bytes(array: np.ndarray) -> np.ndarray:
    """A C-contiguous little-endian version of ``array`` (no copy when it already is one)."""
    array = np.asarray(array)  # indexing a 0-d array with () gives a NumPy scalar
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


def byte_view(array: np.ndarray) -> memoryview:
    """The raw bytes of a C-contiguous array, without a copy (works for 0-d and empty arrays)."""
    return memoryview(array.reshape(-1).view(np.uint8))


# =========================================================================== data files
@dataclass(frozen=True)
class FileEntry:
    """One tensor of a safetensors file: its key, dtype code, shape and byte range in the data.

    ``box`` is the chunk's global box as recorded in the file's own header (``None`` in files
    written before it was recorded): the loader checks it against ``metadata.json``, so boxes
    swapped in the metadata cannot put a chunk's values in another chunk's place.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int
    box: tuple[tuple[int, int], ...] | None = None


BOXES_KEY = "mpipar.boxes"
"""Key in a data file's ``__metadata__``: JSON of each chunk key's global box."""

MAX_HEADER_BYTES = 100 << 20
"""A safetensors header longer than this is refused (safetensors itself caps it at 100 MB).
Parsing one takes at most ``MEMORY_FACTOR`` (48) times its size, or it is refused first: at most
4.7 GiB at this cap; a header of 100k chunk entries (6.8 MB) took 12x here."""
MAX_DIM = 1 << 48
"""Largest extent of one dimension read from a checkpoint (bounds every size computed from it)."""


def build_header(entries: Iterable[FileEntry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus JSON header of a safetensors file, padded so data starts 8-aligned."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.stop]}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(len(body) + 8) % _HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_error(path: str, field_path: str, value: Any, problem: str) -> CheckpointError:
    return CheckpointError(
        field_path=f"(safetensors header) {field_path}",
        value=value,
        problem=problem + "; the file is corrupted or not from this checkpoint",
        source=path,
    )


def read_header(fileobj: Any, path: str) -> tuple[int, dict[str, FileEntry]]:
    """Parse a safetensors header as untrusted input: the offset where data starts and the entries by key.

    The header length is bounded by the file's real size, the JSON goes through ``parse_json``,
    every entry's dtype, shape and byte range are checked (range inside the file, length equal
    to the shape's bytes) before anything is read from the data section.
    """
    raw = fileobj.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"data file {path} is truncated: {len(raw)} bytes, not even a safetensors header")
    (length,) = struct.unpack("<Q", raw)
    size = os.fstat(fileobj.fileno()).st_size
    if length > size - 8 or length > MAX_HEADER_BYTES:
        # The claimed length is not quoted: for a foreign file it is just its first 8 bytes.
        raise CheckpointError(
            f"data file {path} is corrupted or truncated: its safetensors header does not fit in the file "
            f"({size} bytes)"
        )
    body = fileobj.read(length)
    try:
        header = parse_json(
            body, kind="checkpoint", source=path, max_bytes=MAX_HEADER_BYTES, max_depth=8, memory_factor=MEMORY_FACTOR
        )
    except FileFormatError as exc:
        raise CheckpointError.of(exc) from None
    if not isinstance(header, dict):
        raise _header_error(path, "<header>", type(header).__name__, "is not a JSON object")
    data_start = 8 + length
    boxes = _header_boxes(header.get("__metadata__"), path)
    entries: dict[str, FileEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CheckpointError(f"data file {path} has a corrupted header entry for {key!r}: {info!r}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
            raise _header_error(path, f"{key!r}.dtype", dtype, f"is not one of {sorted(_ST_ITEMSIZE)}")
        if not isinstance(shape, list) or len(shape) > 64 or not all(_is_int(n) and 0 <= n <= MAX_DIM for n in shape):
            raise _header_error(path, f"{key!r}.shape", shape, f"is not a list of ints in [0, {MAX_DIM}]")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) for n in offsets):
            raise _header_error(path, f"{key!r}.data_offsets", offsets, "is not a pair of ints")
        start, stop = offsets
        if not 0 <= start <= stop or data_start + stop > size:
            raise CheckpointError(
                f"data file {path} is truncated or corrupted: {key!r} claims bytes [{start}, {stop}) of the data "
                f"section, which ends at {size - data_start}"
            )
        nbytes = _ST_ITEMSIZE[dtype]
        for n in shape:
            nbytes *= n
        if stop - start != nbytes:
            raise _header_error(
                path, f"{key!r}.data_offsets", offsets, f"span {stop - start} bytes, but {dtype}{shape} takes {nbytes}"
            )
        entries[key] = FileEntry(key, dtype, tuple(shape), start, stop, boxes.get(key))
    return data_start, entries


def _header_boxes(meta: Any, path: str) -> dict[str, tuple[tuple[int, int], ...]]:
    """The chunk boxes a data file records about itself (none in files written before they were)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise _header_error(path, "__metadata__", meta, "is not a JSON object")
    text = meta.get(BOXES_KEY)
    if text is None:
        return {}
    if not isinstance(text, str):
        raise _header_error(path, f"__metadata__[{BOXES_KEY!r}]", text, "is not a string")
    try:
        raw = parse_json(text, kind="checkpoint", source=path, max_depth=8)
    except FileFormatError as exc:
        raise CheckpointError.of(exc) from None
    if not isinstance(raw, dict):
        raise _header_error(path, f"__metadata__[{BOXES_KEY!r}]", raw, "is not a JSON object")
    boxes: dict[str, tuple[tuple[int, int], ...]] = {}
    for key, box in raw.items():
        if not isinstance(box, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(n) for n in r) for r in box
        ):
            raise _header_error(
                path, f"__metadata__[{BOXES_KEY!r}][{key!r}]", box, "is not a list of [start, stop] pairs"
            )
        boxes[key] = tuple((r[0], r[1]) for r in box)
    return boxes


def open_data_file(path: str) -> Any:
    """Open a data file for reading: a regular file only (a FIFO or device would block or never end)."""
    try:
        return open_regular(path, kind="checkpoint", field_path="data file")
    except FileFormatError as exc:
        raise CheckpointError.of(exc) from None


def read_into(fileobj: Any, offset: int, out: np.ndarray) -> int:
    """Fill the C-contiguous ``out`` with the bytes at ``offset`` (positioned reads); bytes read."""
    view = byte_view(out)
    fileobj.seek(offset)
    done = 0
    while done < len(view):
        n = fileobj.readinto(view[done:])
        if not n:
            raise CheckpointError(f"data file {fileobj.name} ended after {offset + done} bytes while reading")
        done += n
    return done


def fsync_dir(path: str) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


WRITEBACK_BYTES = 8 << 20
"""Writeback of a data file is started every this many bytes, so the disk works while later
bytes are still being written and the final fsync has little left to wait for."""


def _sync_file_range() -> Any:
    """Linux's ``sync_file_range`` (which ``os`` does not wrap), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` to disk now (a hint: where
    it is unavailable or fails, the fsync that follows still writes everything)."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_file_durably(path: str, chunks: Iterable[Any], *, wait: bool = True) -> Future[None] | None:
    """Write the bytes-like ``chunks`` to ``path`` and fsync it.

    Writeback starts every ``WRITEBACK_BYTES`` while writing. With ``wait=False`` the fsync (and
    close) runs on a worker thread and its future is returned: a process writing several files
    (the simulator hosts every rank) writes the next one while the disk flushes this one. The
    file is durable once the future is done; its error, if any, is raised by ``result()``.
    """
    f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed here, or by the fsync task
    try:
        fd, written, flushed = f.fileno(), 0, 0
        for c in chunks:
            view = memoryview(c)
            done = 0
            while done < len(view):
                done += f.write(view[done:])
            written += done
            if written - flushed >= WRITEBACK_BYTES:
                start_writeback(fd, flushed, written - flushed)
                flushed = written
    except BaseException:
        f.close()
        raise
    if wait:
        _fsync_and_close(f)
        return None
    return worker("fsync").submit(_fsync_and_close, f)


def _fsync_and_close(f: Any) -> None:
    try:
        os.fsync(f.fileno())
    finally:
        f.close()


# ============================================================================ metadata
def dump_metadata(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, indent=1, sort_keys=False, allow_nan=False).encode("utf-8")


METADATA_INT_DIGITS = 80
"""Integers in metadata.json may be this long: a saved RNG state holds 128-bit ints (39 digits)."""
MAX_METADATA_BYTES = 256 << 20
"""A metadata.json larger than this is refused (a 1024-rank checkpoint's is a few MiB)."""


def describe_missing(path: str) -> str:
    """Why ``path`` holds no loadable checkpoint: absent, interrupted, or half swapped."""
    path = os.path.normpath(path)
    parent, base = os.path.split(path)
    if os.path.isdir(path):
        data = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if PARTIAL_TAG in base or data:
            return (
                f"incomplete checkpoint {path}: it has no {METADATA} (written last by a save), so the save "
                f"that wrote it was interrupted ({len(data)} data file(s) present). It cannot be loaded; "
                "load the previous checkpoint and delete this directory"
            )
        return f"{path} is not an mpipar checkpoint: it has no {METADATA}"
    siblings = sorted(os.listdir(parent or ".")) if os.path.isdir(parent or ".") else []
    partial = [s for s in siblings if s.startswith(base + PARTIAL_TAG)]
    replaced = [s for s in siblings if s.startswith(base + REPLACED_TAG)]
    msg = f"no checkpoint at {path}"
    if replaced:
        complete = [p for p in partial if os.path.exists(os.path.join(parent, p, METADATA))]
        msg += (
            f": a save replacing it was interrupted between its two renames; the previous checkpoint is intact "
            f"at {os.path.join(parent, replaced[-1])}"
        )
        if complete:
            msg += f" and the new, complete one at {os.path.join(parent, complete[-1])}"
        msg += f"; rename the one you want to {path}"
    elif partial and os.path.exists(os.path.join(parent, partial[-1], METADATA)):
        msg += (
            f": a save into it wrote everything but was interrupted before its final rename; the complete "
            f"checkpoint is at {os.path.join(parent, partial[-1])}: rename it to {path}"
        )
    elif partial:
        msg += (
            f": a save into it was interrupted and left the incomplete {os.path.join(parent, partial[-1])} "
            "(refused: no metadata); delete it and load an earlier checkpoint"
        )
    return msg
