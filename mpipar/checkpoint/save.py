"""``save_state_dict``: each rank writes the chunks it owns; the metadata goes last; then one rename.

Protocol (every rank calls it; ``Coordinator.agree`` after each step that can fail on one rank)::

    1. flatten the state, check the target path        agree; all_gather a digest of the layout
    2. reduce Partial tensors (reshard, collective)     so stored values are the global ones
    3. leader: lock P (flock), pick the token, create   agree (also the barrier before writing)
       P.partial-<token> and write our marker in it first
    4. every rank: write and fsync rank<r>.safetensors  agree; all_gather the chunk checksums
    5. leader: metadata.json (tmp, fsync, rename), fsync the directory, then
       rename P -> P.replaced-<token> (if P exists), P.partial-<token> -> P, fsync the parent,
       delete P.replaced-<token>                       agree: the save returns on every rank
                                                        only once the checkpoint is in place

An interrupted save leaves ``P`` untouched (or, killed between the two renames of step 5, the
previous checkpoint intact at ``P.replaced-<token>``); the partial directory has no metadata and
``load_state_dict`` refuses it, saying so. Under MPI every rank writes into the same temporary
directory: the checkpoint path must be on a filesystem all ranks share (NFS, Lustre, GPFS, or
one node's local disk).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from mpipar._modes import Mode, execution_mode
from mpipar._xp import to_numpy
from mpipar.backend import current_backend
from mpipar.checkpoint.coord import Coordinator
from mpipar.checkpoint.format import (
    BOXES_KEY,
    CHECKSUM,
    FORMAT,
    MAX_METADATA_BYTES,
    METADATA,
    METADATA_INT_DIGITS,
    PARTIAL_TAG,
    REPLACED_TAG,
    VERSION,
    CheckpointError,
    FileEntry,
    as_le_bytes,
    build_header,
    byte_view,
    checksum,
    checksum_async,
    dump_metadata,
    fsync_dir,
    st_dtype,
    write_file_durably,
)
from mpipar.checkpoint.layout import (
    PIECE_BYTES,
    FilePlan,
    Leaf,
    Piece,
    flatten_state,
    plan_chunks,
    unpartial_placements,
)
from mpipar.checkpoint.ownership import (
    SaveLock,
    is_checkpoint_ours,
    is_commit_leftover,
    remove_stale_partials,
    write_marker,
)
from mpipar.checkpoint.stats import note_write
from mpipar.checkpoint.validate import check_metadata
from mpipar.distribute import reshard
from mpipar.spec import box_relative
from mpipar.tensor import Tensor
from mpipar.untrusted import FileFormatError, parse_json
from mpipar.version import __version__

after_file_written: list[Callable[[str], None]] = []
"""Called with each data file's path once it is fsynced (tests pause a save here). A process
writing several files calls them once all are written, in file order as each becomes durable."""


def save_state_dict(
    state_dict: dict[str, Any], path: str | os.PathLike[str], *, piece_bytes: int = PIECE_BYTES
) -> None:
    """Save ``state_dict`` to the directory ``path`` (a collective: every process calls it).

    ``state_dict`` is a (nested) dict of names to distributed or dense ``Tensor``s, NumPy
    arrays and JSON-able values (ints, floats, strings, bools, None, lists, dicts). Each rank
    writes only the chunks it owns; replicas are written once; Partial tensors are reduced
    first. The save is atomic: ``path`` holds either the previous checkpoint or the new one.
    ``piece_bytes`` caps the size of one stored chunk (larger boxes are cut into row slabs).
    """
    backend = current_backend()
    mode = execution_mode((), backend)
    one_device = mode is Mode.DENSE  # the reference backend: whole values, one writer
    if mode is Mode.ABSTRACT:
        raise ValueError("save_state_dict: tensors in shape-only mode carry no data; run with data to save")
    if not isinstance(piece_bytes, int) or piece_bytes < 1:
        raise ValueError(f"save_state_dict piece_bytes must be a positive int, got {piece_bytes!r}")
    target = os.path.abspath(os.fspath(path))
    if os.path.islink(target):
        # Save where the link points, so the link itself stays (renaming onto it would replace it).
        target = os.path.realpath(target)
    what = f"checkpoint save to {target}"
    coord = Coordinator(backend, what)

    # 1. flatten and check: every rank must describe the same state.
    error: BaseException | None = None
    digest = 0
    try:
        structure, leaves = flatten_state(state_dict)
        _check_target(target)
        # Plain values are written once, from the leader, so they must agree too.
        structure_json = json.dumps(structure, allow_nan=False)
        _check_loadable(structure_json)
        description = _layout_description(leaves) + structure_json
        digest = checksum(description.encode("utf-8"))
    except Exception as exc:
        error = exc
    coord.raise_if_failed(error, what)
    digests = coord.gather({r: np.array([digest], dtype=np.int64) for r in coord.hosted}, np.int64)
    differing = [r for r, d in zip(coord.world, digests, strict=True) if int(d[0]) != int(digests[0][0])]
    if differing:
        raise ValueError(
            f"{what}: ranks {differing} pass a state dict whose names, shapes, dtypes, layouts or plain values "
            f"differ from rank {coord.world[0]}'s; every rank must pass the same state dict (plain values are "
            "stored once: keep per-rank values in a list indexed by rank)"
        )

    # 2. reduce Partial tensors (a collective on each tensor's mesh), in name order on every rank.
    stored: dict[str, Tensor | np.ndarray] = {}
    for leaf in sorted(leaves, key=lambda lf: lf.name):
        stored[leaf.name] = leaf.value
        if leaf.kind == "dist":
            assert leaf.spec is not None
            leaf.stored_spec = leaf.spec
            if (leaf.spec.is_partial or leaf.spec.zigzag) and not one_device:
                # Stored without Partial, and in plain boxes (a zigzag split reshards to Shard).
                pls = unpartial_placements(leaf.spec.natural())
                stored[leaf.name] = reshard(leaf.value, leaf.spec.mesh, pls)
                leaf.stored_spec = leaf.spec.with_placements(pls)
    pieces, files = plan_chunks(leaves, coord.world, one_device, piece_bytes)

    # 3. the temporary directory, created by the leader before anyone writes into it, under the
    # leader's lock on the path (held until the final rename): a second save to it is refused.
    lock = SaveLock(target)
    try:
        _write_steps_3_to_5(coord, lock, target, what, leaves, pieces, files, stored, structure, one_device, backend)
    finally:
        lock.__exit__(None, None, None)


def _write_steps_3_to_5(
    coord: Coordinator,
    lock: SaveLock,
    target: str,
    what: str,
    leaves: list[Leaf],
    pieces: dict[str, list[Piece]],
    files: dict[int, FilePlan],
    stored: dict[str, Any],
    structure: dict[str, Any],
    one_device: bool,
    backend: Any,
) -> None:
    error: BaseException | None = None
    token = coord.token()
    tmp = f"{target}{PARTIAL_TAG}{token:016x}"
    made = False
    try:
        if coord.is_leader:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            lock.__enter__()
            _check_target(target)  # again, under the lock: another save may have just finished
            remove_stale_partials(target)
            os.mkdir(tmp)
            made = True
            write_marker(tmp)  # first: only a marked directory is ever cleaned up as ours
    except Exception as exc:
        error = exc
    if made and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    coord.raise_if_failed(error, what)

    # 4. every rank writes its own file.
    crcs: dict[int, list[int]] = {}
    try:
        crcs = _write_files(tmp, files, coord.hosted, stored, one_device)
    except Exception as exc:
        error = exc
    _fail_and_clean(coord, error, what, tmp)
    gathered = coord.gather({r: np.array(crcs.get(r, []), dtype=np.int64) for r in coord.hosted}, np.int64)
    crc_of = {r: [int(c) for c in g] for r, g in zip(coord.world, gathered, strict=True)}

    # 5. the leader writes the metadata last, then puts the directory in place.
    try:
        if coord.is_leader:
            meta = _metadata(leaves, pieces, files, crc_of, structure, coord, backend.name)
            _commit(target, tmp, token, meta)
    except Exception as exc:
        error = exc
    _fail_and_clean(coord, error, what, tmp)


def _fail_and_clean(coord: Coordinator, error: BaseException | None, what: str, tmp: str) -> None:
    failures = coord.agree(error)
    if not failures:
        return
    if coord.is_leader:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    rank, msg = failures[0]
    raise CheckpointError(f"{what} failed on rank {rank}: {msg}")


def _check_target(target: str) -> None:
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise ValueError(f"checkpoint path {target} exists and is not a directory; choose another path")
        if os.listdir(target) and not os.path.exists(os.path.join(target, METADATA)):
            raise ValueError(
                f"checkpoint path {target} is a non-empty directory without {METADATA}, so not an mpipar "
                "checkpoint; refusing to replace it (choose another path or empty it)"
            )


def _check_loadable(structure_json: str) -> None:
    """Refuse at save what the loader would refuse: the same JSON caps (depth, integer digits,
    size) that ``load_metadata`` applies to the metadata.json this structure goes into."""
    try:
        # As stored: {"state": structure}, one level under the metadata's top object.
        parse_json(
            '{"state":' + structure_json + "}",
            kind="checkpoint",
            source="the state dict being saved",
            max_bytes=MAX_METADATA_BYTES,
            max_int_digits=METADATA_INT_DIGITS,
        )
    except FileFormatError as exc:
        raise ValueError(
            f"save_state_dict: the state dict cannot be saved as a loadable checkpoint: {exc.problem} "
            f"(value {str(exc.value)[:60]!r}); every checkpoint must load with load_state_dict, which applies "
            "these limits: flatten deep nesting, store huge integers as strings"
        ) from None


def _layout_description(leaves: list[Leaf]) -> str:
    rows = []
    for leaf in sorted(leaves, key=lambda lf: lf.name):
        spec = str(leaf.spec) if leaf.spec is not None else ""
        rows.append(f"{leaf.name}|{leaf.kind}|{list(leaf.shape)}|{leaf.dtype.name}|{spec}")
    return "\n".join(rows)


def _piece_array(value: Tensor | np.ndarray, piece: Piece, reference: bool) -> np.ndarray:
    if isinstance(value, Tensor):
        local = value.local_tensor(piece.owner) if value.is_dist and not reference else value.local_tensor()
    else:
        local = value
    part = np.asarray(to_numpy(local)[box_relative(piece.box, piece.cell)])
    # Strided views (a column shard) are streamed through a bounce buffer by _raw_blocks.
    return as_le_bytes(part) if part.dtype.byteorder == ">" else part


_BOUNCE_BYTES = 4 << 20


def _raw_blocks(array: np.ndarray, bounce: np.ndarray) -> Any:
    """The C-order bytes of ``array`` as a few buffers, without copying a contiguous array and
    without allocating a full copy of a strided one (its leading-dim slabs go through ``bounce``)."""
    if array.flags.c_contiguous:
        yield byte_view(array)
        return
    row_bytes = array.nbytes // array.shape[0] if array.ndim and array.shape[0] else array.nbytes
    if array.ndim == 0 or row_bytes > bounce.nbytes:
        yield byte_view(np.ascontiguousarray(array))
        return
    step = max(1, bounce.nbytes // row_bytes)
    for start in range(0, array.shape[0], step):
        slab = array[start : start + step]
        out = bounce[: slab.nbytes].view(array.dtype).reshape(slab.shape)
        np.copyto(out, slab)
        yield byte_view(out)  # written before the next slab overwrites the buffer


def _write_files(
    tmp: str, files: dict[int, FilePlan], hosted: tuple[int, ...], stored: dict[str, Any], reference: bool
) -> dict[int, list[int]]:
    """Write the files of the ranks this process hosts, each one's fsync overlapping the writing
    of the next; return (their CRCs by rank) only once every one is durable."""
    crcs: dict[int, list[int]] = {}
    pending: list[tuple[str, Future[None]]] = []
    failure: BaseException | None = None
    try:
        for rank, plan in files.items():
            if rank in hosted:
                crcs[rank], durable = _write_file(tmp, plan, stored, reference)
                pending.append((os.path.join(tmp, plan.name), durable))
    except BaseException as exc:
        failure = exc
    for path, durable in pending:  # every fsync ends before the save goes on, or cleans up
        try:
            durable.result()
            if failure is None:
                for hook in after_file_written:
                    hook(path)
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    return crcs


def _write_file(tmp: str, plan: FilePlan, stored: dict[str, Any], reference: bool) -> tuple[list[int], Future[None]]:
    """Write one rank's file (header, then each piece straight from its buffer): its CRCs in
    order, and the future of its fsync."""
    arrays = [_piece_array(stored[p.name], p, reference) for p in plan.pieces]
    entries = [
        FileEntry(p.key, st_dtype(a.dtype, f"tensor {p.name!r}"), tuple(a.shape), start, stop)
        for p, a, (start, stop) in zip(plan.pieces, arrays, plan.offsets, strict=True)
    ]
    # The boxes go in the file's own header too, so the loader can tell a box swapped in metadata.json.
    boxes = json.dumps({p.key: [list(r) for r in p.box] for p in plan.pieces}, separators=(",", ":"))
    header = build_header(entries, {"format": FORMAT, "rank": str(plan.rank), BOXES_KEY: boxes})
    crcs: list[int] = []

    bounce = np.empty(_BOUNCE_BYTES, dtype=np.uint8)

    def chunks() -> Any:
        yield header
        for a in arrays:
            crc = 0
            for block in _raw_blocks(a, bounce):
                pending = checksum_async(block, crc)
                yield block  # written while the CRC runs; both only read the block
                crc = pending.result()  # before the bounce buffer is refilled
            crcs.append(crc)

    path = os.path.join(tmp, plan.name)
    durable = write_file_durably(path, chunks(), wait=False)
    assert durable is not None
    note_write(path, len(header) + sum(a.nbytes for a in arrays))
    return crcs, durable


def _metadata(
    leaves: list[Leaf],
    pieces: dict[str, list[Piece]],
    files: dict[int, FilePlan],
    crc_of: dict[int, list[int]],
    structure: dict[str, Any],
    coord: Coordinator,
    backend_name: str,
) -> dict[str, Any]:
    crc_by_key: dict[str, int] = {}
    for rank, plan in files.items():
        if len(crc_of[rank]) != len(plan.pieces):
            raise CheckpointError(
                f"rank {rank} reported {len(crc_of[rank])} checksums for the {len(plan.pieces)} chunks of "
                f"{plan.name}; the ranks disagree on the layout"
            )
        crc_by_key.update({p.key: c for p, c in zip(plan.pieces, crc_of[rank], strict=True)})
    tensors: dict[str, Any] = {}
    for leaf in leaves:
        spec, stored = leaf.spec, leaf.stored_spec
        tensors[leaf.name] = {
            "kind": leaf.kind,
            "shape": list(leaf.shape),
            "dtype": leaf.dtype.name,
            "mesh": spec.mesh.to_dict() if spec is not None else None,
            "placements": spec.placements_str if spec is not None else None,
            "stored_placements": stored.placements_str if stored is not None else None,
            "chunks": [
                {
                    "file": files[p.owner].name,
                    "key": p.key,
                    "box": [list(r) for r in p.box],
                    "nbytes": p.nbytes,
                    CHECKSUM: crc_by_key[p.key],
                }
                for p in pieces[leaf.name]
            ],
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "checksum": CHECKSUM,
        "mpipar_version": __version__,
        "backend": backend_name,
        "world_size": len(coord.world),
        "files": [plan.name for plan in files.values()],
        "tensors": tensors,
        "state": structure,
    }


def _commit(target: str, tmp: str, token: int, meta: dict[str, Any]) -> None:
    """Put the complete ``tmp`` in place of ``target``; raise only while ``target`` is unchanged.

    Once ``tmp`` is renamed to ``target`` the save has succeeded: what follows (fsync of the
    parent, removing the previous checkpoint and the leftovers of earlier interrupted commits)
    is best effort, with a warning, never an exception that would stop a run over a save
    that worked.
    """
    # The loader's own checks, before the checkpoint exists: a save never leaves one it cannot load.
    try:
        check_metadata(meta, tmp)
    except CheckpointError as exc:
        raise ValueError(
            f"save_state_dict: refusing to write a checkpoint load_state_dict would refuse: {exc}"
        ) from None
    meta_tmp = os.path.join(tmp, METADATA + ".tmp")
    write_file_durably(meta_tmp, [dump_metadata(meta)])
    os.replace(meta_tmp, os.path.join(tmp, METADATA))
    fsync_dir(tmp)
    aside = None
    if os.path.exists(target):
        aside = f"{target}{REPLACED_TAG}{token:016x}"
        os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except OSError:
        if aside is not None:
            os.rename(aside, target)  # put the previous checkpoint back before reporting
        raise
    try:
        fsync_dir(os.path.dirname(target))
    except OSError as exc:
        warnings.warn(
            f"checkpoint {target} is in place, but fsync of its parent directory failed ({exc}); "
            "the rename may not survive a power loss",
            RuntimeWarning,
            stacklevel=3,
        )
    remove_commit_leftovers(target)


def remove_commit_leftovers(target: str) -> list[str]:
    """Delete what interrupted commits to ``target`` left beside it, once ``target`` is a complete checkpoint.

    Only our own leftovers go, recognised both by name (``<target>.replaced-<token>``,
    ``<target>.partial-<token>``) and by the ``metadata.json`` an mpipar save wrote in them;
    anything else (a link, a directory without our metadata, another name) is left alone.
    Failures are warnings: this never makes a save or load fail. Returns the removed paths.
    """
    parent, base = os.path.split(os.path.normpath(target))
    if not is_checkpoint_ours(target):
        return []
    removed = []
    try:
        siblings = os.listdir(parent or ".")
    except OSError:
        return []
    for entry in sorted(siblings):
        if not is_commit_leftover(base, parent, entry):
            continue
        full = os.path.join(parent, entry)
        try:
            shutil.rmtree(full)
            removed.append(full)
        except OSError as exc:
            warnings.warn(
                f"checkpoint {target} is in place, but its leftover {full} could not be removed ({exc}); "
                "delete it by hand",
                RuntimeWarning,
                stacklevel=3,
            )
    return removed
