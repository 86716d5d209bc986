"""Reading plan and timeline files for the dashboard: JSON only, readable errors, never pickle.

    kind, doc = load_document(open("plan.json", "rb").read(), "plan.json")   # Plan or Timeline
    plan = load_plan_bytes(data, "plan.json")

Every failure is a ``VizFileError`` whose message names the file, the field and the value at
fault (the dashboard shows it as is, never a traceback): not UTF-8, not JSON (truncated files
land here with the line and column), a JSON value of the wrong kind, another ``format``, a
pickle (refused by its magic byte: the dashboard never unpickles anything), or a field the
plan/timeline loaders reject. Bytes are decoded by ``mpipar.untrusted.parse_json`` (depth cap,
bounded numbers) and documents checked by ``Plan.from_dict``/``Timeline.from_dict``, which
check everything the views rely on (placements that fit, local shapes, resolved references):
the dashboard does not keep checks of its own that the library would not make.
"""

from __future__ import annotations

import os
from typing import Any

from mpipar.compile.plan import FORMAT as PLAN_FORMAT
from mpipar.compile.plan import Plan
from mpipar.debug.timeline import FORMAT as TIMELINE_FORMAT
from mpipar.debug.timeline import Timeline
from mpipar.untrusted import MAX_JSON_BYTES, MEMORY_FACTOR, FileFormatError, parse_json, read_bounded

MAX_FILE_BYTES = MAX_JSON_BYTES
"""Larger files are refused before parsing (``mpipar.untrusted.MAX_JSON_BYTES``: with the memory
factor it bounds parsing at 48x the file; a 1024-rank plan is some 15 MB)."""


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
        return parse_json(data, kind="plan or timeline", max_bytes=MAX_FILE_BYTES, memory_factor=MEMORY_FACTOR)
    except FileFormatError as exc:
        raise _named(name, exc) from None


def _named(name: str, exc: FileFormatError) -> VizFileError:
    """``name: <kind> field <path>: <value> <problem>``; a whole-file problem reads ``name: the file ...``."""
    if exc.field == "<file>":
        return VizFileError(f"{name}: the file {exc.problem}")
    return VizFileError(f"{name}: {FileFormatError(exc.kind, exc.field, exc.value, exc.problem)}")


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
    """Read a file given on the command line (missing, unreadable or special files are ``VizFileError`` too)."""
    name = os.fspath(path)
    try:
        data = read_bounded(name, kind="plan or timeline", max_bytes=MAX_FILE_BYTES)
    except FileFormatError as exc:
        # "cannot be opened (No such file...)": say it as the dashboard always has.
        problem = exc.problem.replace("cannot be opened", "cannot read the file", 1)
        raise VizFileError(f"{name}: {problem}") from None
    return load_document(data, name)


def _plan_from_doc(doc: dict[str, Any], name: str) -> Plan:
    try:
        return Plan.from_dict(doc)
    except FileFormatError as exc:
        raise _named(name, exc) from None


def _timeline_from_doc(doc: dict[str, Any], name: str) -> Timeline:
    try:
        return Timeline.from_dict(doc)
    except FileFormatError as exc:
        raise _named(name, exc) from None
