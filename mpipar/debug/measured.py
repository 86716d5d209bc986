"""Measured timelines: what every rank computed and communicated, when (``MPIPAR_TRACE``).

    MPIPAR_TRACE=run.json mpiexec -n 8 python examples/gpt.py --mesh dp=2,tp=2,pp=2 --tiny
    MPIPAR_TRACE=sim.json python -m simulator -n 8 examples/gpt.py --mesh dp=2,tp=2,pp=2 --tiny
    python -m mpipar.debug.measured run.json --chrome run.trace.json   # summary; Perfetto file

With ``MPIPAR_TRACE=path`` set, tracing starts with the backend and ``path`` is written when
the script exits normally: one ``mpipar.timeline`` file (``mpipar.debug.timeline.Timeline``) with a
lane per rank of the world.

* **compute** track: one span per op (``dispatch.apply``), named by the op (``matmul``), of
  kind ``F``, ``B`` or ``OPT`` by the phase it ran in (forward, backward, optimizer; ``OTHER``
  outside them). A span covers the op's local work: from the end of the last communication
  the op needed (its input reshards) or its start, to its end. Ops nest rarely (an op called
  inside another); both are recorded.
* **comm** track: one span per call of the communicator (``mpipar.comm``), named by the
  collective and the group (``all_reduce(sum) on [0, 2]``), kind ``COLL``; point-to-point
  transfers are ``send to 4`` (``SEND``), ``recv from 0`` (``RECV``) or ``exchange with 0, 4``
  (``COLL``), with ``peer`` set when there is one peer. A span is the whole call: the wait
  for the group's slowest member included.

Where the spans come from:

* **Under MPI** (and NCCL) each process records its own rank's spans on ``time.perf_counter``
  relative to an origin read right after a barrier when the backend starts, so the lanes
  share a time axis (within the barrier's exit skew: microseconds on one host, more across
  hosts, whose clocks are independent). At exit rank 0 gathers every rank's spans with
  buffer calls (``Gatherv`` of int64, float64 and UTF-8 byte arrays; no pickle), merges them
  (``Timeline.merge``) and writes the file; the job's other ranks write nothing. A rank with
  no span still gets its (empty) lane.
* **In the simulator** one process plays every rank: an op's span is recorded on the lane of
  every rank it ran for (the ranks of its mesh; an op on dense tensors on every rank), a
  collective's on every member of its group, all on this process's wall clock. Lanes of one
  op are therefore identical intervals: they show what each virtual rank did and in which
  order, not how long a real rank would take (the cost model predicts that).

Both record at most ``MAX_SPANS`` spans per process (the rest are counted in the file's
``meta.dropped_spans``). Recording costs two clock reads and a small record per op and per
communicator call; nothing at all without ``MPIPAR_TRACE``.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpipar import comm as _comm
from mpipar import hooks
from mpipar._modes import Mode, execution_mode
from mpipar.backend import Backend, start_hooks
from mpipar.debug.timeline import SPAN_KINDS, TRACKS, Span, SpanRecorder, Timeline
from mpipar.env import env_text
from mpipar.untrusted import printable

ENV = "MPIPAR_TRACE"
MAX_SPANS = 2_000_000
"""Spans one process records at most (about 150 bytes each in memory)."""
PHASE_KINDS = {"forward": "F", "backward": "B", "optimizer": "OPT"}
_NO_INT = -1  # stage / microbatch / peer absent, in the gathered int64 records
_INT_FIELDS = 7  # rank, name index, kind index, track index, stage, microbatch, peer


class MeasuredTrace:
    """Records compute and comm spans of the ranks ``backend`` hosts (module docstring).

    trace = MeasuredTrace(backend).start()
    ...                                   # run ops
    trace.stop()
    timeline = trace.timeline()           # collective under MPI: the whole world's on rank 0
    """

    def __init__(self, backend: Backend, origin: float | None = None) -> None:
        self.backend = backend
        self.one_device = execution_mode((), backend) is Mode.DENSE
        """The reference backend: every span is on the one big device's lane 0."""
        self.clock = _comm.span_clock
        self.origin = self.clock() if origin is None else origin
        self._lanes: dict[int, SpanRecorder] = {}
        self._dense: list[tuple[str, str, float, float]] = []
        self._open: list[tuple[str, float]] = []
        self._last_comm_end = -math.inf
        self.recorded = 0
        self.dropped = 0
        self._started = False

    # ------------------------------------------------------------------ switching on and off
    def start(self) -> MeasuredTrace:
        if not self._started:
            hooks.op_start_hooks.append(self)
            hooks.op_hooks.append(self)
            _comm._span_recorders.append(self)
            self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            hooks.op_start_hooks.remove(self)
            hooks.op_hooks.remove(self)
            _comm._span_recorders.remove(self)
            self._started = False

    # ------------------------------------------------------------------ hooks
    def on_op_start(self, name: str) -> None:
        self._open.append((name, self.clock()))

    def on_op(
        self,
        op: Any,
        inputs: Sequence[Any],
        used: Sequence[Any],
        outputs: Sequence[Any],
        result: Any,
        attrs: dict[str, Any],
    ) -> None:
        end = self.clock()
        start = None
        while self._open:  # an op that raised never reached here: drop its entry
            name, t0 = self._open.pop()
            if name == op.name:
                start = t0
                break
        if start is None:  # began before tracing started
            return
        start = min(max(start, self._last_comm_end), end)
        kind = PHASE_KINDS.get(hooks.current_phase(), "OTHER")
        mesh = next((t.spec.mesh for t in (*outputs, *used) if t.is_dist), None)
        own = self.backend.program_rank
        if self.one_device:
            ranks: Iterable[int] = (0,)  # one big device
        elif own is not None and mesh is None:  # a per-rank program's own work (simulator.per_rank)
            ranks = (own,)
        elif own is not None and own != 0:  # every per-rank thread repeats it: keep rank 0's copy
            return
        elif mesh is None:
            if self._room():
                self._dense.append((op.name, kind, start, end))
            return
        else:
            ranks = self.backend.hosted_ranks(mesh)
        for r in ranks:
            if self._room():
                self._lane(r).add(op.name, kind, start, end, track="compute")

    def record_comm(
        self, name: str, kind: str, ranks: Sequence[int], start: float, end: float, peer: int | None
    ) -> None:
        self._last_comm_end = end
        for r in ranks:
            if self.backend.hosts(r) and self._room():
                self._lane(r).add(name, kind, start, end, track="comm", peer=peer)

    def _lane(self, rank: int) -> SpanRecorder:
        lane = self._lanes.get(rank)
        if lane is None:
            lane = self._lanes[rank] = SpanRecorder(rank, clock=self.clock, origin=self.origin)
        return lane

    def _room(self) -> bool:
        if self.recorded >= MAX_SPANS:
            self.dropped += 1
            return False
        self.recorded += 1
        return True

    # ------------------------------------------------------------------ results
    def world_ranks(self) -> list[int]:
        if self.one_device:
            return [0]
        return list(range(max(self.backend.world_size, max(self._lanes, default=-1) + 1)))

    def local_spans(self) -> list[Span]:
        """This process's spans: its lanes, and ops on dense tensors on each rank it hosts."""
        spans = [s for lane in self._lanes.values() for s in lane.spans]
        hosted = [r for r in self.world_ranks() if self.one_device or self.backend.hosts(r)]
        for name, kind, start, end in self._dense:
            spans.extend(
                Span(r, name, kind, None, None, start - self.origin, end - self.origin, "compute") for r in hosted
            )
        return spans

    def timeline(self, meta: dict[str, Any] | None = None) -> Timeline | None:
        """The world's timeline. Under MPI a collective of every rank; None on ranks other than 0."""
        info = {
            "source": "measured",
            "backend": self.backend.name,
            "world_size": len(self.world_ranks()),
            "time_origin": "a barrier when the backend started"
            if isinstance(self.backend, GathersTimelines)
            else "the start of tracing",
            "clock": "time.perf_counter, seconds",
        }
        hosts = getattr(self.backend, "rank_hosts", None)
        if hosts is not None:  # the hosts the launcher assigned (mpipar launch --hosts)
            info["hosts"] = {str(r): h for r, h in enumerate(hosts)}
        info.update(meta or {})
        spans = self.local_spans()
        if not isinstance(self.backend, GathersTimelines):
            info["dropped_spans"] = self.dropped
            return Timeline(spans, ranks=self.world_ranks(), time_unit="s", meta=info)
        parts = self.backend.gather_at_root(encode_spans(spans, self.dropped))
        if parts is None:
            return None
        per_rank, dropped = [], 0
        for arrays in parts:
            rank_spans, rank_dropped = decode_spans(arrays)
            dropped += rank_dropped
            per_rank.append(Timeline(rank_spans, ranks=sorted({s.rank for s in rank_spans}), time_unit="s"))
        info["dropped_spans"] = dropped
        merged = Timeline.merge(per_rank, meta=info)
        # every rank of the world gets a lane, even one that recorded nothing
        return Timeline(
            merged.spans, ranks=sorted(set(merged.ranks) | set(self.world_ranks())), time_unit="s", meta=merged.meta
        )

    def write(self, path: str) -> Timeline | None:
        """Stop recording, build the world's timeline and save it at ``path`` (rank 0)."""
        self.stop()
        timeline = self.timeline({"script": " ".join(sys.argv)})
        if timeline is None:
            return None
        timeline.save(path)
        dropped = timeline.meta.get("dropped_spans", 0)
        note = f"; {dropped} spans over the limit of {MAX_SPANS} per process were dropped" if dropped else ""
        print(
            f"mpipar: wrote the measured timeline {path} ({len(timeline.ranks)} ranks, {len(timeline.spans)} spans{note})",
            file=sys.stderr,
            flush=True,
        )
        return timeline


@runtime_checkable
class GathersTimelines(Protocol):
    """A backend where each process hosts part of the world (MPI, NCCL): the timeline's time
    origin is a barrier of the world, and rank 0 gathers every rank's spans."""

    def trace_origin(self) -> float: ...

    def gather_at_root(self, arrays: Sequence[np.ndarray]) -> list[list[np.ndarray]] | None: ...


# ---------------------------------------------------------------------- buffer encoding
def encode_spans(spans: Sequence[Span], dropped: int = 0) -> list[np.ndarray]:
    """Spans as three flat arrays for buffer-based gathers: int64 records, float64 times, names.

    ``ints``: ``dropped`` then per span (rank, name index, kind index, track index, stage,
    microbatch, peer; -1 for absent); ``times``: (start, end) per span; ``names``: the
    distinct names, UTF-8, NUL-separated.
    """
    names: dict[str, int] = {}
    ints = np.empty(1 + _INT_FIELDS * len(spans), dtype=np.int64)
    ints[0] = dropped
    times = np.empty(2 * len(spans), dtype=np.float64)
    for i, s in enumerate(spans):
        if "\0" in s.name:
            raise ValueError(f"span name {s.name!r} contains a NUL character, which the timeline encoding reserves")
        index = names.setdefault(s.name, len(names))
        base = 1 + _INT_FIELDS * i
        ints[base : base + _INT_FIELDS] = (
            s.rank,
            index,
            SPAN_KINDS.index(s.kind),
            TRACKS.index(s.track),
            _NO_INT if s.stage is None else s.stage,
            _NO_INT if s.microbatch is None else s.microbatch,
            _NO_INT if s.peer is None else s.peer,
        )
        times[2 * i : 2 * i + 2] = (s.start, s.end)
    blob = np.frombuffer("\0".join(names).encode("utf-8"), dtype=np.uint8)
    return [ints, times, blob]


def decode_spans(arrays: Sequence[np.ndarray]) -> tuple[list[Span], int]:
    """``encode_spans``'s arrays back to spans, and the dropped count."""
    ints, times, blob = arrays
    count = (len(ints) - 1) // _INT_FIELDS
    if len(ints) != 1 + _INT_FIELDS * count or len(times) != 2 * count:
        raise ValueError(f"malformed span records: {len(ints)} ints and {len(times)} times do not describe whole spans")
    names = bytes(blob).decode("utf-8").split("\0") if count else []
    records = ints[1:].reshape(count, _INT_FIELDS).tolist()
    bounds = times.reshape(count, 2).tolist()
    spans = [
        Span(
            rank,
            names[name],
            SPAN_KINDS[kind],
            None if stage < 0 else stage,
            None if mb < 0 else mb,
            start,
            end,
            TRACKS[track],
            None if peer < 0 else peer,
        )
        for (rank, name, kind, track, stage, mb, peer), (start, end) in zip(records, bounds, strict=True)
    ]
    return spans, int(ints[0])


# ---------------------------------------------------------------------- MPIPAR_TRACE
_active: MeasuredTrace | None = None


def active() -> MeasuredTrace | None:
    """The trace ``MPIPAR_TRACE`` started in this process, if any."""
    return _active


def start_from_env(backend: Backend, environ: Any = None) -> MeasuredTrace | None:
    """Start the process's trace when ``MPIPAR_TRACE`` names a file (called when the backend starts).

    Under MPI this is a collective (a barrier that aligns the ranks' time origins); every
    rank starts its backend, so every rank calls it. The file is written at exit.
    """
    global _active
    raw = env_text(ENV, environ) or ""
    if not raw or _active is not None or execution_mode((), backend) is Mode.ABSTRACT:
        return _active
    path = os.path.abspath(raw)
    folder = os.path.dirname(path)
    if backend.rank == 0 and not os.path.isdir(folder):
        raise ValueError(
            f"{ENV}={raw!r}: the folder {folder!r} does not exist; create it or name a file in an existing folder"
        )
    origin = backend.trace_origin() if isinstance(backend, GathersTimelines) else None
    _active = MeasuredTrace(backend, origin).start()
    atexit.register(_active.write, path)
    return _active


# ---------------------------------------------------------------------- reading one

start_hooks.append(start_from_env)  # the backend calls it when MPIPAR_TRACE is set


def summary(timeline: Timeline, top: int = 8) -> str:
    """Per rank: compute and comm time and the share of the run; the ops and collectives that took longest."""
    lines = [
        f"{len(timeline.ranks)} ranks, {len(timeline.spans)} spans, {timeline.makespan:.4f} s from first to last span"
    ]
    lines.append(f"{'rank':>5} {'compute s':>10} {'comm s':>9} {'compute %':>10} {'spans':>7}")
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    span = timeline.makespan or 1.0
    for r in timeline.ranks:
        compute = timeline.busy(r)
        comm = sum(s.duration for s in timeline.lane(r, "comm"))
        lines.append(f"{r:>5} {compute:>10.4f} {comm:>9.4f} {100 * compute / span:>9.1f}% {len(timeline.lane(r)):>7}")
    for s in timeline.spans:
        entry = totals[(s.track, s.name)]
        entry[0] += s.duration
        entry[1] += 1
    for track in TRACKS:
        ranked = sorted(((v[0], v[1], name) for (t, name), v in totals.items() if t == track), reverse=True)[:top]
        if ranked:
            lines.append(f"longest on the {track} track (all ranks):")
            lines.extend(f"  {total:10.4f} s  {int(n):>6} x  {name}" for total, n, name in ranked)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.debug.measured",
        description="Summarize a measured timeline; export it as a Chrome trace.",
    )
    parser.add_argument("timeline", help="an mpipar.timeline file (MPIPAR_TRACE=path wrote it)")
    parser.add_argument("--chrome", metavar="PATH", help="also write Chrome trace-event JSON (open in ui.perfetto.dev)")
    ns = parser.parse_args(argv)
    try:
        timeline = Timeline.load(ns.timeline)
    except (ValueError, OSError) as exc:
        print(f"{parser.prog}: {printable(exc)}", file=sys.stderr)
        return 2
    # Names in the summary come from the file: escape sequences in them reach no terminal.
    print(printable(summary(timeline), keep_newlines=True))
    if ns.chrome:
        timeline.save_chrome_trace(ns.chrome)
        print(f"wrote {ns.chrome}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
