"""Reading plan and timeline files for the dashboard: JSON only, readable errors, never pickle.

    kind, doc = load_document(open("plan.json", "rb").read(), "plan.json")   # Plan or Timeline
    plan = load_plan_bytes(data, "plan.json")

Every failure is a ``VizFileError`` whose message names the file, the field and the value at
fault (the dashboard shows it as is, never a traceback): not UTF-8, not JSON (truncated files
land here with the line and column), a JSON value of the wrong kind, another ``format``, a
pickle (refused by its magic byte: the dashboard never unpickles anything), or a field the
plan/timeline loaders reject. Beyond ``Plan.from_dict`` the views need placements that parse
and fit their mesh and tensor, local shapes for every rank, and reshard/op references that
resolve; ``check_plan`` checks those so a view never meets a half-valid plan.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mpipar.placement import Partial, Shard, parse_placements
from mpipar.plan import FORMAT as PLAN_FORMAT
from mpipar.plan import Plan, PlanFormatError
from mpipar.timeline import FORMAT as TIMELINE_FORMAT
from mpipar.timeline import Timeline, TimelineFormatError

MAX_FILE_BYTES = 1 << 30
"""Larger files are refused before parsing (a 1024-rank plan is a few MiB)."""


class VizFileError(ValueError):
    """A file the dashboard cannot show; the message says which file, field and value, and why."""


def _decode(data: bytes, name: str) -> Any:
    if not isinstance(data, bytes | bytearray):
        raise VizFileError(f"{name}: expected the file's bytes, got {type(data).__name__}")
    if len(data) > MAX_FILE_BYTES:
        raise VizFileError(f"{name}: {len(data)} bytes is over the dashboard's limit of {MAX_FILE_BYTES} bytes")
    if not data.strip():
        raise VizFileError(f"{name}: the file is empty; expected an mpipar plan or timeline (JSON)")
    if data[:1] == b"\x80":
        raise VizFileError(
            f"{name}: this looks like a Python pickle; the dashboard reads JSON only and never unpickles "
            "files. Write plans with Plan.save(path) and timelines with Timeline.save(path)."
        )
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VizFileError(
            f"{name}: not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); expected an mpipar "
            "plan or timeline (JSON)"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise VizFileError(
            f"{name}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); is the file truncated?"
        ) from None
    except RecursionError:
        raise VizFileError(f"{name}: JSON nested too deeply to be a plan or timeline") from None


def load_document(data: bytes, name: str = "<upload>") -> Plan | Timeline:
    """A plan or a timeline, told apart by the top-level ``format`` field."""
    doc = _decode(data, name)
    if not isinstance(doc, dict):
        raise VizFileError(f"{name}: the top level is a JSON {type(doc).__name__}, not an object with a 'format' field")
    fmt = doc.get("format")
    if fmt == PLAN_FORMAT:
        return _plan_from_doc(doc, name)
    if fmt == TIMELINE_FORMAT:
        return _timeline_from_doc(doc, name)
    if "traceEvents" in doc:
        raise VizFileError(
            f"{name}: this is a Chrome trace (traceEvents), an export for Perfetto; load the mpipar timeline "
            "JSON it was made from instead"
        )
    raise VizFileError(
        f"{name}: field format is {fmt!r}; expected {PLAN_FORMAT!r} (a plan) or {TIMELINE_FORMAT!r} (a timeline)"
    )


def load_plan_bytes(data: bytes, name: str = "<upload>") -> Plan:
    doc = load_document(data, name)
    if not isinstance(doc, Plan):
        raise VizFileError(f"{name}: this is a timeline ({TIMELINE_FORMAT!r}), not a plan; load it as the timeline")
    return doc


def load_timeline_bytes(data: bytes, name: str = "<upload>") -> Timeline:
    doc = load_document(data, name)
    if not isinstance(doc, Timeline):
        raise VizFileError(f"{name}: this is a plan ({PLAN_FORMAT!r}), not a timeline; load it as the plan")
    return doc


def load_path(path: str | os.PathLike[str]) -> Plan | Timeline:
    """Read a file given on the command line (missing or unreadable files are ``VizFileError`` too)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise VizFileError(f"{name}: cannot read the file ({exc.strerror or exc})") from None
    return load_document(data, name)


def _plan_from_doc(doc: dict[str, Any], name: str) -> Plan:
    try:
        plan = Plan.from_dict(doc)
    except PlanFormatError as exc:
        raise VizFileError(f"{name}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a shape Plan.from_dict did not foresee
        raise VizFileError(f"{name}: malformed plan ({type(exc).__name__}: {exc})") from None
    check_plan(plan, name)
    return plan


def _timeline_from_doc(doc: dict[str, Any], name: str) -> Timeline:
    try:
        return Timeline.from_dict(doc)
    except TimelineFormatError as exc:
        raise VizFileError(f"{name}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise VizFileError(f"{name}: malformed timeline ({type(exc).__name__}: {exc})") from None


def _check_placements(text: str, mesh_ndim: int, ndim: int, where: str, name: str) -> None:
    try:
        pls = parse_placements(text)
    except (TypeError, ValueError) as exc:
        raise VizFileError(f"{name}: plan field {where}: {text!r} is not a placement list ({exc})") from None
    if len(pls) != mesh_ndim:
        raise VizFileError(
            f"{name}: plan field {where}: {text!r} has {len(pls)} placement(s) for a mesh of {mesh_ndim} axes"
        )
    kinds = set()
    for p in pls:
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            raise VizFileError(f"{name}: plan field {where}: {text!r} shards dim {p.dim} of a {ndim}-d tensor")
        if isinstance(p, Partial):
            kinds.add(p.reduce_type)
    if len(kinds) > 1 and not kinds <= {"sum", "avg"}:
        raise VizFileError(f"{name}: plan field {where}: {text!r} mixes Partial reduce types that do not commute")


def check_plan(plan: Plan, name: str = "plan") -> None:
    """Refuse what ``Plan.from_dict`` lets through but the views cannot draw (see the module docstring)."""
    meshes = {m.id: m for m in plan.meshes}
    if len(meshes) != len(plan.meshes):
        raise VizFileError(f"{name}: plan field meshes: two meshes share an id")
    for i, m in enumerate(plan.meshes):
        if len(set(m.process_ids)) != len(m.process_ids) or any(r < 0 for r in m.process_ids):
            raise VizFileError(f"{name}: plan field meshes[{i}].process_ids: repeats a rank or has a negative one")
        if len(set(m.dim_names)) != len(m.dim_names):
            raise VizFileError(f"{name}: plan field meshes[{i}].dim_names: {list(m.dim_names)} repeats a name")
        if any(n < 1 for n in m.shape):
            raise VizFileError(f"{name}: plan field meshes[{i}].shape: {list(m.shape)} has an empty axis")
    ids = [t.id for t in plan.tensors]
    if len(set(ids)) != len(ids):
        raise VizFileError(f"{name}: plan field tensors: two tensors share an id")
    tensors = {t.id: t for t in plan.tensors}
    for i, t in enumerate(plan.tensors):
        if any(n < 0 for n in t.shape):
            raise VizFileError(f"{name}: plan field tensors[{i}].shape: {list(t.shape)} has a negative size")
        if t.mesh is None:
            continue
        mesh = meshes[t.mesh]
        _check_placements(t.placements, len(mesh.shape), len(t.shape), f"tensors[{i}].placements", name)
        if t.local_shapes and len(t.local_shapes) != len(mesh.process_ids):
            raise VizFileError(
                f"{name}: plan field tensors[{i}].local_shapes: {len(t.local_shapes)} shapes for a mesh of "
                f"{len(mesh.process_ids)} ranks"
            )
        for j, s in enumerate(t.local_shapes):
            if len(s) != len(t.shape) or any(a < 0 or a > b for a, b in zip(s, t.shape, strict=True)):
                raise VizFileError(
                    f"{name}: plan field tensors[{i}].local_shapes[{j}]: {list(s)} does not fit the tensor "
                    f"shape {list(t.shape)}"
                )
    for i, r in enumerate(plan.reshards):
        for field_name, tid in (("tensor", r.tensor), ("new_tensor", r.new_tensor)):
            if tid not in tensors:
                raise VizFileError(f"{name}: plan field reshards[{i}].{field_name}: {tid} names no tensor of the plan")
        if any(n < 0 for n in r.shape):
            raise VizFileError(f"{name}: plan field reshards[{i}].shape: {list(r.shape)} has a negative size")
        for end, mid, pls in (("src", r.src_mesh, r.src), ("dst", r.dst_mesh, r.dst)):
            _check_placements(pls, len(meshes[mid].shape), len(r.shape), f"reshards[{i}].{end}.placements", name)
        src_mesh, dst_mesh = meshes[r.src_mesh], meshes[r.dst_mesh]
        ranks = set(src_mesh.process_ids) | set(dst_mesh.process_ids)
        for j, s in enumerate(r.steps):
            for a in s.axes:
                if a not in src_mesh.dim_names:
                    raise VizFileError(
                        f"{name}: plan field reshards[{i}].steps[{j}].axes: {a!r} is not an axis of mesh "
                        f"{src_mesh.id} {list(src_mesh.dim_names)}"
                    )
            for k, piece in enumerate(s.pieces):
                if len(piece) != 3 or piece[0] not in ranks or piece[1] not in ranks or piece[2] < 0:
                    raise VizFileError(
                        f"{name}: plan field reshards[{i}].steps[{j}].pieces[{k}]: {list(piece)} is not "
                        "(src rank, dst rank, bytes) between the reshard's meshes"
                    )
    n_reshards = len(plan.reshards)
    for i, o in enumerate(plan.ops):
        for j, ri in enumerate(o.reshards):
            if not 0 <= ri < n_reshards:
                raise VizFileError(f"{name}: plan field ops[{i}].reshards[{j}]: {ri} names no reshard of the plan")
