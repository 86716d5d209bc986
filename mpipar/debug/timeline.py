"""Timelines: what each rank did when, predicted (simulator) or measured (MPI runtime).

A ``Timeline`` holds ``Span`` records, one lane per rank with a ``compute`` and a ``comm``
track, and optionally memory over time per rank by category (``MEMORY_CATEGORIES``). It is a
JSON file kind of its own, read by the simulator and the dashboard::

    {"format": "mpipar.timeline", "version": 1, "time_unit": "s" | "unit",
     "ranks": [0, 1],
     "spans": [{"rank": 0, "name": "0F0", "kind": "F", "stage": 0, "microbatch": 0,
                "start": 0.0, "end": 1.0, "track": "compute", "peer": null}, ...],
     "memory": {"categories": ["parameters", ...],            # optional
                "ranks": [{"rank": 0, "times": [...], "bytes": {"parameters": [...], ...}}]},
     "meta": {...}}                                           # free-form, JSON values

Span names of pipeline actions are the canonical tokens of ``mpipar.pipeline`` (``0F1``,
``1RECV_B0``); ``kind`` is F, B, W, SEND or RECV, and a runtime may add OPT (optimizer step),
COLL (a collective; the name says which) and OTHER. Memory curves are step functions: the
bytes of a category hold from ``times[i]`` until ``times[i+1]``.

``Timeline.load`` refuses a malformed file with a ``TimelineFormatError`` that names the field
and the value at fault. ``to_chrome_trace()`` gives trace-event JSON (``chrome://tracing`` and
https://ui.perfetto.dev open it): a process per rank, a thread per track, arrows from each send
to its receive, memory as counter tracks.

    >>> t = Timeline([Span(0, "0F0", "F", 0, 0, 0.0, 1.0)], time_unit="unit")
    >>> t.makespan, t.bubble_fraction()
    (1.0, 0.0)
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipar.pipeline.actions import TOKEN_RE, matching, parse_action
from mpipar.untrusted import MEMORY_FACTOR, FileFormatError, parse_json, read_bounded

FORMAT = "mpipar.timeline"
VERSION = 1
TRACKS = ("compute", "comm")
SPAN_KINDS = ("F", "B", "W", "SEND", "RECV", "OPT", "COLL", "OTHER")
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers")
_KIND_SET = frozenset(SPAN_KINDS)
_TRACK_SET = frozenset(TRACKS)
TIME_UNITS = ("s", "unit")
_CHROME_US_PER = {"s": 1e6, "unit": 1e3}  # one virtual time unit shows as one millisecond


MAX_TIMELINE_INT = 1 << 62
"""Ranks, stages, microbatches and peers at or beyond this are refused."""
MAX_TIMELINE_STR = 1 << 16
"""Longer span names are refused: they are a flood, not a label."""


TimelineFormatError = FileFormatError
"""A timeline that does not follow the format: the one format error of every file mpipar reads
(``kind`` "timeline"; ``field`` is the path at fault). The name is kept for callers and tests."""


@dataclass(frozen=True)
class Span:
    """One interval of work on one rank's compute or comm track."""

    rank: int
    name: str
    kind: str
    stage: int | None
    microbatch: int | None
    start: float
    end: float
    track: str = "compute"
    peer: int | None = None

    def __post_init__(self) -> None:
        # Fast path for the common, valid case; anything odd gets the full check and its message.
        if not (
            type(self.rank) is int
            and self.rank >= 0
            and type(self.name) is str
            and self.name
            and self.kind in _KIND_SET
            and self.track in _TRACK_SET
            and type(self.start) in (int, float)
            and type(self.end) in (int, float)
            and math.isfinite(self.start)
            and math.isfinite(self.end)
            and self.end >= self.start
            and (self.stage is None or (type(self.stage) is int and self.stage >= 0))
            and (self.microbatch is None or (type(self.microbatch) is int and self.microbatch >= 0))
            and (self.peer is None or (type(self.peer) is int and self.peer >= 0))
        ):
            _check_span(self.to_dict(), "span")

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "name": self.name,
            "kind": self.kind,
            "stage": self.stage,
            "microbatch": self.microbatch,
            "start": self.start,
            "end": self.end,
            "track": self.track,
            "peer": self.peer,
        }


@dataclass(frozen=True, eq=True)
class MemoryCurve:
    """Bytes held by one rank over time, per category, as a step function over ``times``."""

    rank: int
    times: tuple[float, ...]
    bytes: Mapping[str, tuple[float, ...]] = field(hash=False)

    def __post_init__(self) -> None:
        _check_memory_rank(
            {"rank": self.rank, "times": list(self.times), "bytes": {k: list(v) for k, v in self.bytes.items()}},
            "memory curve",
            tuple(self.bytes),
        )

    @classmethod
    def from_deltas(
        cls, rank: int, deltas: Iterable[tuple[float, str, float]], baseline: Mapping[str, float] | None = None
    ) -> MemoryCurve:
        """Build from (time, category, +/- bytes) changes on top of ``baseline`` bytes at time 0.

        Frees at a given time are applied before allocations at that time, so a buffer freed
        and another allocated at the same instant never count together.
        """
        current = {c: float((baseline or {}).get(c, 0.0)) for c in MEMORY_CATEGORIES}
        times: list[float] = [0.0]
        series: dict[str, list[float]] = {c: [current[c]] for c in MEMORY_CATEGORIES}
        for t, category, delta in sorted(deltas, key=lambda d: (d[0], d[2] > 0)):
            if category not in current:
                raise ValueError(f"memory category {category!r} is unknown; use one of {', '.join(MEMORY_CATEGORIES)}")
            current[category] += delta
            if t == times[-1]:
                for c in MEMORY_CATEGORIES:
                    series[c][-1] = current[c]
            else:
                times.append(float(t))
                for c in MEMORY_CATEGORIES:
                    series[c].append(current[c])
        # Float sums of +x and -x can leave -1e-9; clamp so the curve stays a valid byte count.
        return cls(rank, tuple(times), {c: tuple(max(0.0, v) for v in series[c]) for c in MEMORY_CATEGORIES})

    def total(self) -> list[float]:
        return [sum(self.bytes[c][i] for c in self.bytes) for i in range(len(self.times))]

    def peak(self) -> tuple[float, float, dict[str, float]]:
        """(time, total bytes, bytes per category) at the first moment the total is highest."""
        totals = self.total()
        i = max(range(len(totals)), key=lambda k: (totals[k], -k))
        return self.times[i], totals[i], {c: self.bytes[c][i] for c in self.bytes}

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "times": list(self.times), "bytes": {c: list(v) for c, v in self.bytes.items()}}


class Timeline:
    """Spans per rank (compute and comm tracks), optional memory curves, and free-form meta."""

    def __init__(
        self,
        spans: Iterable[Span],
        *,
        ranks: Iterable[int] | None = None,
        memory: Mapping[int, MemoryCurve] | Iterable[MemoryCurve] | None = None,
        time_unit: str = "s",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        span_list = list(spans)
        for i, s in enumerate(span_list):
            if not isinstance(s, Span):
                raise TypeError(f"Timeline spans[{i}] is {type(s).__name__}, not a Span")
        if time_unit not in TIME_UNITS:
            raise FileFormatError("timeline", "time_unit", time_unit, f"is not one of {', '.join(TIME_UNITS)}")
        rank_list = sorted({s.rank for s in span_list}) if ranks is None else [int(r) for r in ranks]
        if len(set(rank_list)) != len(rank_list):
            raise FileFormatError("timeline", "ranks", rank_list, "repeats a rank")
        known = set(rank_list)
        for i, s in enumerate(span_list):
            if s.rank not in known:
                raise FileFormatError(
                    "timeline", f"spans[{i}].rank", s.rank, f"is not one of the timeline's ranks {rank_list}"
                )
        curves: dict[int, MemoryCurve] | None = None
        if memory is not None:
            items = list(memory.values()) if isinstance(memory, Mapping) else list(memory)
            curves = {}
            for curve in items:
                if not isinstance(curve, MemoryCurve):
                    raise TypeError(f"Timeline memory holds MemoryCurve values, got {type(curve).__name__}")
                if curve.rank not in known:
                    raise FileFormatError(
                        "timeline", "memory.rank", curve.rank, f"is not one of the timeline's ranks {rank_list}"
                    )
                if set(curve.bytes) != set(items[0].bytes):
                    raise FileFormatError(
                        "timeline",
                        f"memory[rank {curve.rank}].bytes",
                        sorted(curve.bytes),
                        f"has other categories than rank {items[0].rank}'s {sorted(items[0].bytes)}; give every rank the same",
                    )
                curves[curve.rank] = curve
        self.spans: tuple[Span, ...] = tuple(
            sorted(span_list, key=lambda s: (s.rank, s.track != "compute", s.start, s.end))
        )
        self._by_rank: dict[int, list[Span]] = {r: [] for r in rank_list}
        for span in self.spans:
            self._by_rank[span.rank].append(span)
        self._busy: dict[int, float] = {}
        self.ranks: tuple[int, ...] = tuple(rank_list)
        self.memory: dict[int, MemoryCurve] | None = curves
        self.time_unit = time_unit
        self.meta: dict[str, Any] = dict(meta or {})

    # ------------------------------------------------------------------ analysis
    @functools.cached_property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @functools.cached_property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        """Step time: from the first span's start to the last span's end, over all ranks."""
        return self.end - self.start

    def lane(self, rank: int, track: str | None = None) -> list[Span]:
        """Rank ``rank``'s spans (of one track, or both), by start time."""
        spans = self._by_rank.get(rank, [])
        return list(spans) if track is None else [s for s in spans if s.track == track]

    def busy(self, rank: int) -> float:
        """Time rank ``rank``'s compute track is busy (overlapping spans counted once)."""
        if rank not in self._busy:
            total, reach = 0.0, -math.inf
            for s in self.lane(rank, "compute"):  # sorted by start
                if s.end > reach:
                    total += s.end - max(s.start, reach)
                    reach = s.end
            self._busy[rank] = total
        return self._busy[rank]

    def bubble(self, rank: int) -> float:
        """Idle compute time of ``rank`` within the step: ``makespan - busy(rank)``."""
        return self.makespan - self.busy(rank)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Share of the step a rank's compute track is idle: ``bubble(rank) / makespan``.

        With ``rank=None``, over all ranks: ``1 - sum(busy) / (ranks * makespan)``, i.e. the mean.
        For FThenB and 1F1B with uniform stages and free communication every rank gets
        ``(p-1)/(m+p-1)``: the step is ``(m+p-1)(tF+tB)`` and each rank computes ``m(tF+tB)``.
        """
        span = self.makespan
        if span <= 0:
            return 0.0
        if rank is not None:
            return self.bubble(rank) / span
        if not self.ranks:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in self.ranks) / (len(self.ranks) * span)

    def peak_memory(self) -> dict[int, float]:
        """Peak total bytes per rank (empty without a memory section)."""
        return {r: c.peak()[1] for r, c in (self.memory or {}).items()}

    # ------------------------------------------------------------------ combining
    @classmethod
    def merge(cls, timelines: Sequence[Timeline], meta: Mapping[str, Any] | None = None) -> Timeline:
        """One timeline from per-rank ones (the MPI runtime gathers each rank's and merges)."""
        if not timelines:
            raise ValueError("Timeline.merge needs at least one timeline")
        units = {t.time_unit for t in timelines}
        if len(units) > 1:
            raise ValueError(f"cannot merge timelines in different time units {sorted(units)}")
        ranks = sorted({r for t in timelines for r in t.ranks})
        memory = [c for t in timelines for c in (t.memory or {}).values()]
        merged_meta: dict[str, Any] = {}
        for t in timelines:
            merged_meta.update(t.meta)
        merged_meta.update(meta or {})
        return cls(
            [s for t in timelines for s in t.spans],
            ranks=ranks,
            memory=memory or None,
            time_unit=units.pop(),
            meta=merged_meta,
        )

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "time_unit": self.time_unit,
            "ranks": list(self.ranks),
            "spans": [s.to_dict() for s in self.spans],
        }
        if self.memory is not None:
            categories = sorted({c for m in self.memory.values() for c in m.bytes}, key=MEMORY_CATEGORIES.index)
            out["memory"] = {
                "categories": categories,
                "ranks": [self.memory[r].to_dict() for r in sorted(self.memory)],
            }
        out["meta"] = self.meta
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Timeline:
        """Read ``to_dict()``'s form, refusing any malformed field (``TimelineFormatError``)."""
        if not isinstance(data, Mapping):
            raise FileFormatError("timeline", "<top level>", type(data).__name__, "is not a JSON object")
        allowed = {"format", "version", "time_unit", "ranks", "spans", "memory", "meta"}
        for key in data:
            if key not in allowed:
                raise FileFormatError(
                    "timeline", str(key), data[key], f"is not a timeline field; fields are {sorted(allowed)}"
                )
        if data.get("format") != FORMAT:
            raise FileFormatError(
                "timeline",
                "format",
                data.get("format"),
                f"is not {FORMAT!r}; this is not an mpipar timeline"
                + (
                    " (it is a plan; open it with the dashboard or the plan loader)"
                    if data.get("format") == "mpipar.plan"
                    else ""
                ),
            )
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise FileFormatError("timeline", "version", version, "is not an integer version")
        if version != VERSION:
            raise FileFormatError(
                "timeline",
                "version",
                version,
                f"is not supported; this mpipar reads timeline version {VERSION}"
                + (" (upgrade mpipar to read newer files)" if version > VERSION else ""),
            )
        time_unit = data.get("time_unit", "s")
        if time_unit not in TIME_UNITS:
            raise FileFormatError("timeline", "time_unit", time_unit, f"is not one of {', '.join(TIME_UNITS)}")
        ranks = data.get("ranks")
        if not isinstance(ranks, list):
            raise FileFormatError("timeline", "ranks", ranks, "is not a list of rank ids")
        for i, r in enumerate(ranks):
            _check_rank(r, f"ranks[{i}]")
        if len(set(ranks)) != len(ranks):
            raise FileFormatError("timeline", "ranks", ranks, "repeats a rank")
        spans_data = data.get("spans")
        if not isinstance(spans_data, list):
            raise FileFormatError("timeline", "spans", spans_data, "is not a list of spans")
        rank_set = set(ranks)
        spans = []
        for i, item in enumerate(spans_data):
            _check_span(item, f"spans[{i}]")
            if item["rank"] not in rank_set:
                raise FileFormatError("timeline", f"spans[{i}].rank", item["rank"], f"is not listed in ranks {ranks}")
            spans.append(
                Span(
                    item["rank"],
                    item["name"],
                    item["kind"],
                    item.get("stage"),
                    item.get("microbatch"),
                    item["start"],
                    item["end"],
                    item["track"],
                    item.get("peer"),
                )
            )
        memory = None
        if data.get("memory") is not None:
            memory = _read_memory(data["memory"], rank_set)
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise FileFormatError("timeline", "meta", meta, "is not a JSON object")
        _check_lane_ranks(meta.get("lane_ranks"))
        return cls(spans, ranks=ranks, memory=memory, time_unit=time_unit, meta=meta)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json(indent=1))
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Timeline:
        """Read a timeline file from anywhere; every refusal is a ``TimelineFormatError`` naming the file."""
        name = os.fspath(path)
        try:
            data = read_bounded(name, kind="timeline")
        except FileFormatError as exc:
            raise FileFormatError("timeline", exc.field, exc.value, exc.problem, name) from None
        return cls.from_json(data, source=name)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "<string>") -> Timeline:
        """Parse through ``mpipar.untrusted.parse_json`` (depth cap, bounded numbers, UTF-8), then check."""
        try:
            data = parse_json(text, kind="timeline", source=source, memory_factor=MEMORY_FACTOR)
            return cls.from_dict(data)
        except FileFormatError as exc:
            if exc.source is not None:
                raise
            raise FileFormatError("timeline", exc.field, exc.value, exc.problem, source) from None

    # ------------------------------------------------------------------ Chrome trace
    def to_chrome_trace(self) -> dict[str, Any]:
        """Trace-event JSON: a process per rank, threads ``compute``/``comm``, send->recv flows, memory counters."""
        scale = _CHROME_US_PER[self.time_unit]
        events: list[dict[str, Any]] = []
        hosts = self.meta.get("hosts")  # the launcher's rank -> host map, when the run had one
        hosts = hosts if isinstance(hosts, dict) else {}
        for rank in self.ranks:
            host = hosts.get(str(rank))
            where = f" @ {host[:200]}" if isinstance(host, str) else ""
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}{where}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for tid, track in enumerate(TRACKS):
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for s in self.spans:
            args = {
                k: v for k, v in (("stage", s.stage), ("microbatch", s.microbatch), ("peer", s.peer)) if v is not None
            }
            events.append(
                {
                    "name": s.name,
                    "cat": s.kind,
                    "ph": "X",
                    "ts": s.start * scale,
                    "dur": (s.end - s.start) * scale,
                    "pid": s.rank,
                    "tid": TRACKS.index(s.track),
                    "args": args,
                }
            )
        events.extend(self._chrome_flows(scale))
        for rank, curve in sorted((self.memory or {}).items()):
            for i, t in enumerate(curve.times):
                events.append(
                    {
                        "ph": "C",
                        "name": "memory (bytes)",
                        "pid": rank,
                        "ts": t * scale,
                        "args": {c: curve.bytes[c][i] for c in curve.bytes},
                    }
                )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "format": FORMAT,
                "version": VERSION,
                "time_unit": self.time_unit,
                "note": "1 virtual time unit = 1 ms" if self.time_unit == "unit" else "seconds as us",
            },
        }

    def _chrome_flows(self, scale: float) -> list[dict[str, Any]]:
        """An arrow from each pipeline send to the receive that matches it."""
        recvs: dict[tuple[str, int, int, int], Span] = {}
        for s in self.spans:
            if s.kind == "RECV" and (action := _as_action(s.name)) is not None:
                recvs[(action.kind, action.stage, action.microbatch, s.rank)] = s
        flows: list[dict[str, Any]] = []
        for s in self.spans:
            if s.kind != "SEND" or s.peer is None or (action := _as_action(s.name)) is None:
                continue
            other = matching(action)
            recv = recvs.get((other.kind, other.stage, other.microbatch, s.peer))
            if recv is None:
                continue
            flow_id = len(flows) // 2 + 1
            common = {"name": f"{s.name} -> {recv.name}", "cat": "transfer", "id": flow_id}
            flows.append({**common, "ph": "s", "pid": s.rank, "tid": TRACKS.index(s.track), "ts": s.start * scale})
            flows.append(
                {
                    **common,
                    "ph": "f",
                    "bp": "e",
                    "pid": recv.rank,
                    "tid": TRACKS.index(recv.track),
                    "ts": recv.end * scale,
                }
            )
        return flows

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_trace(), f)

    def __repr__(self) -> str:
        mem = ", memory" if self.memory is not None else ""
        return f"Timeline({len(self.spans)} spans, ranks={list(self.ranks)}, makespan={self.makespan:g} {self.time_unit}{mem})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


class SpanRecorder:
    """Records one rank's spans as they happen (the runtime's measured timelines).

        rec = SpanRecorder(rank=dist.get_rank(), clock=MPI.Wtime)
        with rec.span("0F3", "F", stage=0, microbatch=3):
            ...
        rec.timeline()

    Times are taken from ``clock`` relative to ``origin`` (default: the clock at construction);
    ranks of one run should share an origin (e.g. read right after a barrier).
    """

    def __init__(self, rank: int, clock: Callable[[], float] = time.perf_counter, origin: float | None = None) -> None:
        self.rank = rank
        self.clock = clock
        self.origin = clock() if origin is None else origin
        self.spans: list[Span] = []

    def add(
        self,
        name: str,
        kind: str,
        start: float,
        end: float,
        *,
        track: str = "compute",
        stage: int | None = None,
        microbatch: int | None = None,
        peer: int | None = None,
    ) -> Span:
        """Add a span with absolute clock times ``start``/``end``."""
        span = Span(self.rank, name, kind, stage, microbatch, start - self.origin, end - self.origin, track, peer)
        self.spans.append(span)
        return span

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        kind: str,
        *,
        track: str = "compute",
        stage: int | None = None,
        microbatch: int | None = None,
        peer: int | None = None,
    ) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(name, kind, start, self.clock(), track=track, stage=stage, microbatch=microbatch, peer=peer)

    def timeline(self, meta: Mapping[str, Any] | None = None) -> Timeline:
        return Timeline(self.spans, ranks=[self.rank], time_unit="s", meta={"source": "measured", **(meta or {})})


# ---------------------------------------------------------------------- field checks
_SPAN_FIELDS = ("rank", "name", "kind", "stage", "microbatch", "start", "end", "track", "peer")
_SPAN_FIELD_SET = frozenset(_SPAN_FIELDS)
_PIPELINE_KINDS = frozenset(("F", "B", "W", "SEND", "RECV"))


def _as_action(name: str) -> Any:
    try:
        return parse_action(name)
    except ValueError:
        return None


def _check_rank(value: Any, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TIMELINE_INT:
        raise FileFormatError("timeline", path, value, "is not an integer rank in [0, 2^62)")


def _check_lane_ranks(value: Any) -> None:
    """``meta.lane_ranks`` (lane -> the ranks of its stage mesh), which the dashboard labels lanes with."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise FileFormatError("timeline", "meta.lane_ranks", value, "is not an object of lane -> list of ranks")
    for lane, members in value.items():
        if not isinstance(members, list):
            raise FileFormatError("timeline", f"meta.lane_ranks.{lane}", members, "is not a list of ranks")
        for i, r in enumerate(members):
            _check_rank(r, f"meta.lane_ranks.{lane}[{i}]")


def _check_exact_float(value: Any, path: str) -> None:
    """Memory curves are stored as floats: an integer no float holds exactly would load changed."""
    if isinstance(value, int) and float(value) != value:
        raise FileFormatError("timeline", path, value, "is an integer no float holds exactly; write it as a float")


def _check_time(value: Any, path: str) -> None:
    # A huge int would overflow math.isfinite itself; 1e300 bounds both kinds.
    if isinstance(value, bool) or not isinstance(value, int | float) or not -1e300 <= value <= 1e300:
        raise FileFormatError("timeline", path, value, "is not a number in [-1e300, 1e300]")


def _check_span(item: Any, path: str) -> None:
    if not isinstance(item, Mapping):
        raise FileFormatError("timeline", path, item, "is not an object with fields " + ", ".join(_SPAN_FIELDS))
    for key in item:
        if key not in _SPAN_FIELD_SET:
            raise FileFormatError(
                "timeline", f"{path}.{key}", item[key], f"is not a span field; fields are {list(_SPAN_FIELDS)}"
            )
    for key in ("rank", "name", "kind", "start", "end", "track"):
        if key not in item:
            raise FileFormatError("timeline", f"{path}.{key}", None, "is missing")
    _check_rank(item["rank"], f"{path}.rank")
    if not isinstance(item["name"], str) or not item["name"] or len(item["name"]) > MAX_TIMELINE_STR:
        raise FileFormatError(
            "timeline",
            f"{path}.name",
            item["name"],
            f"is not a non-empty string of at most {MAX_TIMELINE_STR} characters",
        )
    if item["kind"] not in SPAN_KINDS:
        raise FileFormatError("timeline", f"{path}.kind", item["kind"], f"is not one of {', '.join(SPAN_KINDS)}")
    if item["track"] not in TRACKS:
        raise FileFormatError("timeline", f"{path}.track", item["track"], f"is not one of {', '.join(TRACKS)}")
    for key in ("stage", "microbatch", "peer"):
        value = item.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_TIMELINE_INT
        ):
            raise FileFormatError("timeline", f"{path}.{key}", value, "is not an integer in [0, 2^62) or null")
    _check_time(item["start"], f"{path}.start")
    _check_time(item["end"], f"{path}.end")
    if item["end"] < item["start"]:
        raise FileFormatError("timeline", f"{path}.end", item["end"], f"is before the span's start {item['start']!r}")
    if item["kind"] in _PIPELINE_KINDS and (token := TOKEN_RE.match(item["name"])) is not None:
        # A pipeline token as name must agree with the span's own fields.
        if token.group(2).split("_", 1)[0] != item["kind"]:
            raise FileFormatError("timeline", f"{path}.kind", item["kind"], f"disagrees with its name {item['name']!r}")
        for key, want in (("stage", int(token.group(1))), ("microbatch", int(token.group(3)))):
            if item.get(key) is not None and item[key] != want:
                raise FileFormatError(
                    "timeline", f"{path}.{key}", item[key], f"disagrees with its name {item['name']!r}"
                )


def _check_memory_rank(item: Any, path: str, categories: Sequence[str]) -> None:
    if not isinstance(item, Mapping):
        raise FileFormatError("timeline", path, item, "is not an object with rank, times, bytes")
    for key in ("rank", "times", "bytes"):
        if key not in item:
            raise FileFormatError("timeline", f"{path}.{key}", None, "is missing")
    _check_rank(item["rank"], f"{path}.rank")
    times = item["times"]
    if not isinstance(times, list) or not times:
        raise FileFormatError("timeline", f"{path}.times", times, "is not a non-empty list of times")
    for i, t in enumerate(times):
        _check_time(t, f"{path}.times[{i}]")
        _check_exact_float(t, f"{path}.times[{i}]")
        if i and t < times[i - 1]:
            raise FileFormatError("timeline", f"{path}.times[{i}]", t, f"is before the previous time {times[i - 1]!r}")
    values = item["bytes"]
    if not isinstance(values, Mapping):
        raise FileFormatError("timeline", f"{path}.bytes", values, "is not an object of category -> byte list")
    for cat in values:
        if cat not in MEMORY_CATEGORIES:
            raise FileFormatError(
                "timeline",
                f"{path}.bytes.{cat}",
                values[cat],
                f"is under an unknown category; use {', '.join(MEMORY_CATEGORIES)}",
            )
    for cat in categories:
        series = values.get(cat)
        if not isinstance(series, list) or len(series) != len(times):
            raise FileFormatError(
                "timeline", f"{path}.bytes.{cat}", series, f"is not a list of {len(times)} byte counts (one per time)"
            )
        for i, v in enumerate(series):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1e300:
                raise FileFormatError(
                    "timeline", f"{path}.bytes.{cat}[{i}]", v, "is not a finite non-negative byte count"
                )
            _check_exact_float(v, f"{path}.bytes.{cat}[{i}]")


def _read_memory(data: Any, ranks: set[int]) -> list[MemoryCurve]:
    if not isinstance(data, Mapping):
        raise FileFormatError("timeline", "memory", data, "is not an object with categories and ranks")
    categories = data.get("categories")
    if not isinstance(categories, list) or not categories:
        raise FileFormatError("timeline", "memory.categories", categories, "is not a non-empty list of categories")
    for i, cat in enumerate(categories):
        if cat not in MEMORY_CATEGORIES:
            raise FileFormatError(
                "timeline", f"memory.categories[{i}]", cat, f"is not one of {', '.join(MEMORY_CATEGORIES)}"
            )
        if cat in categories[:i]:
            raise FileFormatError("timeline", f"memory.categories[{i}]", cat, "repeats a category")
    per_rank = data.get("ranks")
    if not isinstance(per_rank, list):
        raise FileFormatError("timeline", "memory.ranks", per_rank, "is not a list of per-rank curves")
    curves = []
    for i, item in enumerate(per_rank):
        path = f"memory.ranks[{i}]"
        _check_memory_rank(item, path, categories)
        if item["rank"] not in ranks:
            raise FileFormatError("timeline", f"{path}.rank", item["rank"], f"is not listed in ranks {sorted(ranks)}")
        extra = [c for c in item["bytes"] if c not in categories]
        if extra:
            raise FileFormatError(
                "timeline", f"{path}.bytes.{extra[0]}", item["bytes"][extra[0]], "is not in memory.categories"
            )
        curves.append(
            MemoryCurve(
                item["rank"],
                tuple(float(t) for t in item["times"]),
                {c: tuple(float(v) for v in item["bytes"][c]) for c in categories},
            )
        )
    return curves
