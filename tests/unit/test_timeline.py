"""Timeline files: round trips, field-level refusal of malformed files, Chrome trace, analysis.

.venv/bin/python -m pytest tests/unit/test_timeline.py -q
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mpipar.debug.timeline import MemoryCurve, Span, SpanRecorder, Timeline, TimelineFormatError
from mpipar.pipeline import build_schedule, parse_action
from simulator import simulate_schedule
from simulator.cost import PipelineCost, StageMemory


def _simulated(with_memory: bool = True) -> Timeline:
    schedule = build_schedule("1F1B", 3, 4)
    memory = StageMemory.uniform(3, parameters=1e6, gradients=1e6, optimizer_state=2e6, activations=5e5, message=1e4)
    cost = PipelineCost.uniform(
        3, forward=1.0, backward_input=1.0, backward_weight=1.0, comm=0.25, memory=memory if with_memory else None
    )
    return simulate_schedule(schedule, cost)


@pytest.mark.parametrize("with_memory", [True, False])
def test_round_trip_file(tmp_path: Path, with_memory: bool) -> None:
    timeline = _simulated(with_memory)
    path = tmp_path / "t.json"
    timeline.save(path)
    loaded = Timeline.load(path)
    assert loaded == timeline
    assert loaded.spans == timeline.spans
    assert loaded.to_dict() == json.loads(path.read_text())
    assert (loaded.memory is None) == (not with_memory)
    assert json.loads(path.read_text())["format"] == "mpipar.timeline"


def test_spans_have_the_api_fields() -> None:
    timeline = _simulated()
    kinds = {s.kind for s in timeline.spans}
    assert kinds == {"F", "B", "SEND", "RECV"}
    for s in timeline.spans:
        assert s.track == ("comm" if s.kind in ("SEND", "RECV") else "compute")
        action = parse_action(s.name)  # span names are the schedule's tokens
        assert (action.span_kind, action.stage, action.microbatch) == (s.kind, s.stage, s.microbatch)
        assert s.end >= s.start
    send = next(s for s in timeline.spans if s.name == "0SEND_F2")
    recv = next(s for s in timeline.spans if s.name == "1RECV_F2")
    assert (send.rank, send.peer, recv.rank, recv.peer) == (0, 1, 1, 0)
    assert (send.start, send.end) == (recv.start, recv.end)
    assert send.duration == 0.25


# Each case: how to break a valid timeline dict, the field the error must name, the value it shows.
Mutation = Callable[[dict[str, Any]], None]
MALFORMED: list[tuple[str, Mutation, str, str]] = [
    ("wrong format", lambda d: d.update(format="mpipar.plan"), "format", "'mpipar.plan'"),
    ("newer version", lambda d: d.update(version=2), "version", "2"),
    ("version not int", lambda d: d.update(version="1"), "version", "'1'"),
    ("time unit", lambda d: d.update(time_unit="ms"), "time_unit", "'ms'"),
    ("unknown field", lambda d: d.update(spnas=[]), "spnas", "[]"),
    ("ranks not list", lambda d: d.update(ranks=3), "ranks", "3"),
    ("negative rank", lambda d: d["ranks"].__setitem__(1, -1), "ranks[1]", "-1"),
    ("span end before start", lambda d: d["spans"][4].update(end=-1.0), "spans[4].end", "-1.0"),
    ("span kind", lambda d: d["spans"][0].update(kind="X"), "spans[0].kind", "'X'"),
    ("span track", lambda d: d["spans"][0].update(track="gpu"), "spans[0].track", "'gpu'"),
    ("span rank unknown", lambda d: d["spans"][0].update(rank=9), "spans[0].rank", "9"),
    ("span stage negative", lambda d: d["spans"][2].update(stage=-3), "spans[2].stage", "-3"),
    ("span start not number", lambda d: d["spans"][1].update(start="0"), "spans[1].start", "'0'"),
    ("span missing name", lambda d: d["spans"][1].pop("name"), "spans[1].name", "None"),
    ("span extra field", lambda d: d["spans"][1].update(colour="red"), "spans[1].colour", "'red'"),
    ("span name/kind disagree", lambda d: d["spans"][0].update(kind="B"), "spans[0].kind", "'B'"),
    ("span name/stage disagree", lambda d: d["spans"][0].update(stage=2), "spans[0].stage", "2"),
    ("memory category", lambda d: d["memory"]["categories"].append("weights"), "memory.categories[5]", "'weights'"),
    (
        "memory length",
        lambda d: d["memory"]["ranks"][1]["bytes"]["activations"].pop(),
        "memory.ranks[1].bytes.activations",
        "[",
    ),
    (
        "memory time order",
        lambda d: d["memory"]["ranks"][0]["times"].__setitem__(2, -5.0),
        "memory.ranks[0].times[2]",
        "-5.0",
    ),
    (
        "memory negative",
        lambda d: d["memory"]["ranks"][0]["bytes"]["parameters"].__setitem__(0, -1),
        "memory.ranks[0].bytes.parameters[0]",
        "-1",
    ),
    ("memory rank", lambda d: d["memory"]["ranks"][0].update(rank=7), "memory.ranks[0].rank", "7"),
    ("meta not object", lambda d: d.update(meta=[1]), "meta", "[1]"),
]


@pytest.mark.parametrize(("case", "mutate", "field", "shown"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_timeline_names_field_and_value(case: str, mutate: Mutation, field: str, shown: str) -> None:
    data = copy.deepcopy(_simulated().to_dict())
    mutate(data)
    with pytest.raises(TimelineFormatError) as info:
        Timeline.from_dict(data)
    assert info.value.field == field
    assert str(info.value).startswith(f"timeline field {field}: {shown}")


def test_truncated_and_non_json_files(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(_simulated().to_json()[:200])
    with pytest.raises(
        TimelineFormatError, match=r"is not valid JSON \(line 1 column \d+: .*\); is the file truncated"
    ):
        Timeline.load(path)
    path.write_text(
        '{"format": "mpipar.timeline", "version": 1, "ranks": [0], "spans": [{"rank": 0, "name": "x", '
        '"kind": "OTHER", "start": NaN, "end": 1, "track": "compute"}]}'
    )
    # NaN is refused while parsing (mpipar.untrusted), before any field is read.
    with pytest.raises(TimelineFormatError, match=r"<number>: 'NaN' is not a finite number"):
        Timeline.load(path)
    with pytest.raises(TimelineFormatError, match="<top level>"):
        Timeline.from_dict([1, 2])


def test_chrome_trace() -> None:
    timeline = _simulated()
    trace = json.loads(json.dumps(timeline.to_chrome_trace()))  # plain JSON, as Perfetto reads it
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(timeline.spans)
    f0 = next(e for e in complete if e["name"] == "1F0")
    span = next(s for s in timeline.spans if s.name == "1F0")
    assert (f0["pid"], f0["tid"], f0["ts"], f0["dur"], f0["cat"]) == (1, 0, span.start * 1e3, span.duration * 1e3, "F")
    assert f0["args"] == {"stage": 1, "microbatch": 0}
    names = {
        (e["pid"], e.get("tid"), e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] != "process_sort_index"
    }
    assert (2, None, "rank 2") in names and (2, 1, "comm") in names and (0, 0, "compute") in names
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    transfers = sum(1 for s in timeline.spans if s.kind == "SEND")
    assert len(starts) == len(finishes) == transfers == 2 * 2 * 4  # 2 boundaries x 2 directions x 4 micro-batches
    assert len({e["id"] for e in starts}) == transfers
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == {0, 1, 2}
    assert set(counters[0]["args"]) == {"parameters", "gradients", "optimizer_state", "activations", "comm_buffers"}


def test_bubble_definitions_on_a_hand_made_timeline() -> None:
    spans = [
        Span(0, "0F0", "F", 0, 0, 0.0, 1.0),
        Span(0, "0B0", "B", 0, 0, 2.0, 3.0),
        Span(1, "1F0", "F", 1, 0, 1.0, 2.0),
        Span(1, "step", "OPT", None, None, 1.5, 2.5),  # overlaps 1F0: counted once
        Span(1, "1SEND_B0", "SEND", 1, 0, 2.5, 3.0, "comm", 0),
    ]
    t = Timeline(spans, time_unit="unit")
    assert t.makespan == 3.0
    assert (t.busy(0), t.busy(1)) == (2.0, 1.5)
    assert t.bubble(1) == 1.5
    assert t.bubble_fraction(0) == pytest.approx(1 / 3)
    assert t.bubble_fraction() == pytest.approx(1 - 3.5 / 6)
    assert [s.name for s in t.lane(1, "comm")] == ["1SEND_B0"]


def test_memory_curve_frees_before_allocating_at_the_same_time() -> None:
    curve = MemoryCurve.from_deltas(
        0,
        [
            (1.0, "activations", 10.0),
            (2.0, "activations", -10.0),
            (2.0, "activations", 10.0),
            (3.0, "activations", -10.0),
        ],
        baseline={"parameters": 5.0},
    )
    assert curve.times == (0.0, 1.0, 2.0, 3.0)
    assert curve.bytes["activations"] == (0.0, 10.0, 10.0, 0.0)
    assert curve.total() == [5.0, 15.0, 15.0, 5.0]
    assert curve.peak() == (
        1.0,
        15.0,
        {"parameters": 5.0, "gradients": 0.0, "optimizer_state": 0.0, "activations": 10.0, "comm_buffers": 0.0},
    )
    with pytest.raises(ValueError, match="memory category 'weights' is unknown"):
        MemoryCurve.from_deltas(0, [(1.0, "weights", 1.0)])


def test_simulated_memory_peaks() -> None:
    timeline = _simulated()
    peaks = timeline.peak_memory()
    # 1F1B on 3 stages, 4 micro-batches: stage i holds min(3 - i, 4) activations at its peak.
    for rank in range(3):
        assert peaks[rank] >= 4e6 + (3 - rank) * 5e5
        assert max(timeline.memory[rank].bytes["activations"]) == (3 - rank) * 5e5
        assert max(timeline.memory[rank].bytes["comm_buffers"]) > 0


def test_recorder_and_merge() -> None:
    ticks = iter([10.0, 10.5, 11.0, 20.0, 21.0])
    rec = SpanRecorder(rank=3, clock=lambda: next(ticks))
    with rec.span("0F0", "F", stage=0, microbatch=0):
        pass
    rec.add("all_reduce grads", "COLL", 20.0, 21.0, track="comm")
    mine = rec.timeline()
    assert [(s.name, s.start, s.end, s.track) for s in mine.spans] == [
        ("0F0", 0.5, 1.0, "compute"),
        ("all_reduce grads", 10.0, 11.0, "comm"),
    ]
    assert mine.meta["source"] == "measured"
    other = Timeline([Span(1, "0F1", "F", 0, 1, 0.0, 2.0)], meta={"host": "a"})
    merged = Timeline.merge([mine, other], meta={"run": 1})
    assert merged.ranks == (1, 3)
    assert merged.meta == {"source": "measured", "host": "a", "run": 1}
    assert len(merged.spans) == 3
    with pytest.raises(ValueError, match="different time units"):
        Timeline.merge([mine, Timeline([], time_unit="unit")])


def test_span_and_timeline_constructors_refuse_bad_values() -> None:
    with pytest.raises(TimelineFormatError, match=r"span\.end: 0\.0 is before the span's start 1\.0"):
        Span(0, "x", "OTHER", None, None, 1.0, 0.0)
    with pytest.raises(TimelineFormatError, match=r"spans\[0\]\.rank: 5 is not one of the timeline's ranks \[0\]"):
        Timeline([Span(5, "x", "OTHER", None, None, 0.0, 1.0)], ranks=[0])
    with pytest.raises(TypeError, match="spans\\[0\\] is dict, not a Span"):
        Timeline([{"rank": 0}])  # type: ignore[list-item]


def test_memory_curves_must_share_categories() -> None:
    a = MemoryCurve(0, (0.0,), {"parameters": (1.0,)})
    b = MemoryCurve(1, (0.0,), {"activations": (1.0,)})
    with pytest.raises(TimelineFormatError, match=r"memory\[rank 1\]\.bytes: \['activations'\] has other categories"):
        Timeline([], ranks=[0, 1], memory=[a, b])
    same = Timeline([], ranks=[0, 1], memory=[a, MemoryCurve(1, (0.0, 2.0), {"parameters": (1.0, 3.0)})])
    assert Timeline.from_dict(same.to_dict()) == same
    assert same.peak_memory() == {0: 1.0, 1: 3.0}
