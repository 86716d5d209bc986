"""Fuzzing plans and timelines from elsewhere: a named error or the exact values, nothing else.

Real documents (the dashboard sample's traced plan and its simulated timeline, a timeline
measured on the clock by ``SpanRecorder`` and merged, and a shape-only plan with 2^40-element
tensors) are mutated by hypothesis: bytes truncated or flipped, values
retyped, nested deeper, deleted, duplicated, swapped between fields, replaced by huge numbers.
Each mutated file is loaded by ``Plan.load``/``Timeline.load`` and by the dashboard's loader
(``viz.files``), each case under a timeout, while an audit hook records every file opened. The
outcome must be one of:

* a named error: ``FileFormatError`` (``PlanFormatError``/``TimelineFormatError``) or ``VizFileError``;
* a load whose values are exactly those of the file (every field the file gives comes back the
  same in ``to_dict()``, and the result round-trips losslessly), which the dashboard's pure
  renderers then draw without error.

Never another exception type, never a hang, never an open of any path but the file itself.
``MPIPAR_FUZZ_EXAMPLES=N`` sets the examples per test (CI default 200, derandomized; about 15 s alone on this machine);
``MPIPAR_FUZZ_EXAMPLES=2000 pytest -m fuzz tests/fuzz/test_fuzz_files.py`` is the long run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import SpanRecorder, Timeline
from mpipar.untrusted import FileFormatError
from viz import comm, layout, timeline_view
from viz.files import VizFileError, load_document
from viz.planinfo import itemsize, tensor_spec
from viz.sample import build_sample

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("MPIPAR_FUZZ_EXAMPLES", "200"))
CASE_TIMEOUT_S = 20.0
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="MPIPAR_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
WORKDIR = tempfile.mkdtemp(prefix="mpipar-fuzz-")
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Audit hooks cannot be removed; this one only records while a case is being loaded.
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


class CaseTimeout(Exception):
    """A single load ran past ``CASE_TIMEOUT_S``: a hang."""


@contextmanager
def _bounded(path: str) -> Iterator[list[str]]:
    """Run a case under a wall-clock alarm, recording every path opened meanwhile."""
    global _OPENED

    def alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"loading {path} took over {CASE_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    _OPENED = []
    opened = _OPENED
    try:
        yield opened
    finally:
        _OPENED = None
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _big_plan() -> dict[str, Any]:
    from tests.unit.test_hostile_files import big_plan

    return big_plan()


def _measured_timeline() -> dict[str, Any]:
    """Two ranks' spans recorded on the real clock, merged as the MPI runtime merges them."""
    per_rank = []
    for rank in (0, 1):
        rec = SpanRecorder(rank=rank)
        for mb in range(2):
            with rec.span(f"{rank}F{mb}", "F", stage=rank, microbatch=mb):
                np.ones((64, 64)) @ np.ones((64, 64))
            with rec.span(
                f"{rank}SEND_F{mb}" if rank == 0 else f"{rank}RECV_F{mb}",
                "SEND" if rank == 0 else "RECV",
                track="comm",
                stage=rank,
                microbatch=mb,
                peer=1 - rank,
            ):
                pass
        per_rank.append(rec.timeline())
    return Timeline.merge(per_rank, meta={"run": "fuzz"}).to_dict()


_SAMPLE_PLAN, _SAMPLE_TIMELINE = build_sample(2, 2, 2, "1F1B", 2, hidden=16, batch=8)
PLANS = [_SAMPLE_PLAN.to_dict(), _big_plan()]
TIMELINES = [_SAMPLE_TIMELINE.to_dict(), _measured_timeline()]

# ---------------------------------------------------------------- mutations


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside ``doc`` (keys and indices)."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.integers(-(1 << 80), 1 << 80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["S(0)", "S(9)", "RS(1)", "P(max)P(sum)", "S(-3)R", "Q", "", "float32", "forward", "x" * 70000]),
)
_VALUES = st.one_of(
    _SCALARS, st.lists(_SCALARS, max_size=3), st.dictionaries(st.text(max_size=4), _SCALARS, max_size=2)
)


@st.composite
def mutated_doc(draw: st.DrawFn, doc: dict[str, Any]) -> Any:
    """A structural mutation of ``doc``: retype, renest, delete, duplicate or swap values."""
    out = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(out)
        path = draw(st.sampled_from(paths))
        how = draw(st.sampled_from(["retype", "renest", "delete", "duplicate", "swap", "huge", "negate"]))
        here = _get(out, path)
        if how == "retype":
            out = _set(out, path, draw(_VALUES))
        elif how == "renest":
            wrapped = here
            for _ in range(draw(st.integers(1, 100))):
                wrapped = [wrapped] if draw(st.booleans()) else {"x": wrapped}
            out = _set(out, path, wrapped)
        elif how == "delete" and path:
            parent = _get(out, path[:-1])
            del parent[path[-1]]
        elif how == "duplicate" and path and isinstance(_get(out, path[:-1]), list):
            _get(out, path[:-1]).append(copy.deepcopy(here))
        elif how == "swap":
            other = draw(st.sampled_from(paths))
            if not (other[: len(path)] == path or path[: len(other)] == other):  # neither inside the other
                there = copy.deepcopy(_get(out, other))
                swapped = _set(copy.deepcopy(out), other, copy.deepcopy(here))
                # If the first write moved what the second path runs through, no swap this round.
                with contextlib.suppress(TypeError, KeyError, IndexError):
                    out = _set(swapped, path, there)
        elif how == "huge" and isinstance(here, int | float) and not isinstance(here, bool):
            out = _set(out, path, draw(st.sampled_from([1 << 62, 1 << 63, 1 << 64, -(1 << 63), 1e308, 10**29])))
        elif how == "negate" and isinstance(here, int | float) and not isinstance(here, bool):
            out = _set(out, path, -here - 1)
    return out


@st.composite
def mutated_bytes(draw: st.DrawFn, doc: dict[str, Any]) -> bytes:
    """A byte-level mutation of ``doc``'s JSON: truncate, flip, insert, or a duplicated key."""
    data = bytearray(json.dumps(doc, indent=draw(st.sampled_from([None, 1]))).encode())
    how = draw(st.sampled_from(["truncate", "flip", "insert", "dupkey", "bigdigits", "nest"]))
    pos = draw(st.integers(0, len(data) - 1))
    if how == "truncate":
        return bytes(data[:pos])
    if how == "flip":
        data[pos] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "insert":
        return bytes(data[:pos]) + draw(st.binary(min_size=1, max_size=8)) + bytes(data[pos:])
    if how == "dupkey":  # JSON lets a key repeat; the last one wins, as for any reader
        return bytes(data[:1]) + b'"version": 1, ' + bytes(data[1:])
    if how == "bigdigits":
        digits = draw(st.sampled_from([25, 31, 400, 5000]))
        return bytes(data).replace(b'"version": 1', b'"version": ' + b"9" * digits, 1)
    depth = draw(st.sampled_from([63, 64, 65, 1000, 100_000]))
    return bytes(data[:-1]) + b', "meta": ' + b"[" * depth + b"]" * depth + b"}"


# ---------------------------------------------------------------- the property


def _agrees(loaded: Any, given_: Any, where: str = "") -> None:
    """Every value the file gives comes back the same (to_dict may add defaulted fields)."""
    if isinstance(given_, dict):
        assert isinstance(loaded, dict), where
        for k, v in given_.items():
            if k in loaded:
                _agrees(loaded[k], v, f"{where}.{k}")
    elif isinstance(given_, list):
        assert isinstance(loaded, list) and len(loaded) == len(given_), where
        for i, (a, b) in enumerate(zip(loaded, given_, strict=True)):
            _agrees(a, b, f"{where}[{i}]")
    else:
        assert loaded == given_ and type(loaded) in (type(given_), float), (where, loaded, given_)


def _canonical(doc: Any) -> Any:
    """A timeline's spans and memory categories come back in canonical order: compare as sets."""
    if not (isinstance(doc, dict) and doc.get("format") == "mpipar.timeline"):
        return doc
    out = dict(doc)
    if isinstance(out.get("spans"), list):
        out["spans"] = sorted(out["spans"], key=lambda s: json.dumps(s, sort_keys=True))
    memory = out.get("memory")
    if isinstance(memory, dict) and isinstance(memory.get("categories"), list):
        out["memory"] = {**memory, "categories": sorted(memory["categories"])}
    return out


def _render_plan(plan: Plan) -> None:
    comm.comm_table(plan)
    comm.traffic_matrix(plan)
    for t in plan.tensors[:6]:
        if t.mesh is not None:
            layout.rank_table(tensor_spec(plan, t), itemsize(t.dtype))


def _render_timeline(timeline: Timeline) -> None:
    timeline_view.bubble_rows(timeline)
    timeline_view.timeline_text(timeline)


def _check(data: bytes, kind: str) -> None:
    path = os.path.join(WORKDIR, f"{kind}.json")
    with open(path, "wb") as f:
        f.write(data)
    cls = Plan if kind == "plan" else Timeline
    loaded: Plan | Timeline | None = None
    with _bounded(path) as opened:
        try:
            loaded = cls.load(path)
        except FileFormatError as exc:
            assert exc.kind == kind and exc.source == path, exc
        except CaseTimeout:
            raise
        except Exception as exc:  # the point: any other type is a finding
            pytest.fail(f"{cls.__name__}.load raised a raw {type(exc).__name__}: {exc}\nfile: {data[:300]!r}")
        try:
            shown = load_document(data, "f.json")
        except VizFileError:
            shown = None
        except CaseTimeout:
            raise
        except Exception as exc:
            pytest.fail(f"viz.files.load_document raised a raw {type(exc).__name__}: {exc}\nfile: {data[:300]!r}")
    assert opened, "the audit hook saw no open: the path check would prove nothing"
    assert {os.path.realpath(p) for p in opened} <= {os.path.realpath(path)}, opened
    if loaded is None:
        assert shown is None, "the dashboard accepted a file the library refuses"
        return
    assert shown is not None and shown.to_dict() == loaded.to_dict(), "the dashboard and the library disagree"
    from mpipar.untrusted import parse_json

    _agrees(_canonical(loaded.to_dict()), _canonical(parse_json(data, kind=kind)))
    assert cls.from_dict(loaded.to_dict()).to_dict() == loaded.to_dict()
    if isinstance(loaded, Plan):
        _render_plan(loaded)
    else:
        _render_timeline(loaded)


@FUZZ
@given(data=st.data())
def test_mutated_plans(data: st.DataObject) -> None:
    doc = data.draw(st.sampled_from(PLANS))
    _check(json.dumps(data.draw(mutated_doc(doc))).encode(), "plan")


@FUZZ
@given(data=st.data())
def test_mutated_plan_bytes(data: st.DataObject) -> None:
    _check(data.draw(mutated_bytes(data.draw(st.sampled_from(PLANS)))), "plan")


@FUZZ
@given(data=st.data())
def test_mutated_timelines(data: st.DataObject) -> None:
    doc = data.draw(st.sampled_from(TIMELINES))
    _check(json.dumps(data.draw(mutated_doc(doc))).encode(), "timeline")


@FUZZ
@given(data=st.data())
def test_mutated_timeline_bytes(data: st.DataObject) -> None:
    _check(data.draw(mutated_bytes(data.draw(st.sampled_from(TIMELINES)))), "timeline")


def test_unmutated_documents_load_exactly() -> None:
    for doc in PLANS:
        _check(json.dumps(doc).encode(), "plan")
        assert Plan.from_dict(doc).to_dict() == doc
    for doc in TIMELINES:
        _check(json.dumps(doc).encode(), "timeline")
        assert Timeline.from_dict(doc).to_dict() == doc
