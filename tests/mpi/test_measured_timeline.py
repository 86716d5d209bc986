"""Measured timelines (``MPIPAR_TRACE``): spans per rank from the simulator and from ``mpiexec``.

In-process tests drive ``mpipar.debug.measured.MeasuredTrace`` on simulator backends; the
``mpi`` tests run an example under ``mpiexec -n 4`` and under ``python -m simulator -n 4``
with ``MPIPAR_TRACE`` and check the file: a lane per rank, compute and comm spans in order,
plausible groups, the same per-rank sequence of spans as the simulator's, a valid Chrome trace.

    .venv/bin/python -m pytest -q tests/mpi/test_measured_timeline.py
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpi_scripts.launch import REPO, mpirun

import mpipar as dist
from mpipar import comm as comm_module
from mpipar import hooks
from mpipar.debug import measured
from mpipar.debug.measured import MeasuredTrace, decode_spans, encode_spans, start_from_env
from mpipar.debug.timeline import SPAN_KINDS, TRACKS, Span, Timeline
from simulator import SimBackend
from simulator.backend import ReferenceBackend

GROUP = re.compile(r" on \[([\d, ]+)\]$")


# ---------------------------------------------------------------------- encoding
span_strategy = st.tuples(
    st.integers(0, 1023),
    st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=12),
    st.sampled_from(SPAN_KINDS),
    st.none() | st.integers(0, 64),
    st.none() | st.integers(0, 64),
    st.floats(0, 1e4, allow_nan=False),
    st.floats(0, 10, allow_nan=False),
    st.sampled_from(TRACKS),
    st.none() | st.integers(0, 1023),
).map(  # the "op " prefix keeps names from reading as pipeline tokens, which must match their kind
    lambda f: Span(f[0], "op " + f[1], f[2], f[3], f[4], f[5], f[5] + f[6], f[7], f[8])
)


@given(st.lists(span_strategy, max_size=30), st.integers(0, 10**6))
def test_span_records_round_trip_through_plain_arrays(spans: list[Span], dropped: int) -> None:
    arrays = encode_spans(spans, dropped)
    assert [a.dtype for a in arrays] == [np.dtype(np.int64), np.dtype(np.float64), np.dtype(np.uint8)]
    back, back_dropped = decode_spans([np.frombuffer(a.tobytes(), dtype=a.dtype) for a in arrays])
    assert back == spans and back_dropped == dropped


def test_a_nul_in_a_span_name_is_refused() -> None:
    with pytest.raises(ValueError, match="contains a NUL character"):
        encode_spans([Span(0, "a\0b", "COLL", None, None, 0.0, 1.0, "comm")])


# ---------------------------------------------------------------------- in the simulator
def _spans(timeline: Timeline, rank: int, track: str) -> list[Span]:
    return timeline.lane(rank, track)


def test_simulator_lanes_hold_each_virtual_ranks_ops_and_collectives() -> None:
    backend = SimBackend(6)
    with dist.use_backend(backend):
        trace = MeasuredTrace(backend).start()
        try:
            mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
            half = dist.ProcessMesh([4, 5], dim_names=["y"])
            x = dist.shard_tensor(np.arange(24.0).reshape(8, 3), mesh, [dist.Shard(0)])
            w = dist.shard_tensor(np.ones((3, 2)), mesh, [dist.Replicate()])
            y = dist.matmul(x, w)  # local on every rank of mesh
            r = dist.reshard(y, mesh, [dist.Replicate()])  # all_gather on [0, 1, 2, 3]
            dist.add(dist.to_tensor(np.ones(2)), dist.to_tensor(np.ones(2)))  # dense: every rank computes it
            with hooks.phase("backward"):
                z = dist.shard_tensor(np.ones((4, 2)), half, [dist.Shard(0)])
                dist.sum(z)  # partial result on [4, 5]
        finally:
            trace.stop()
        timeline = trace.timeline()
    assert timeline is not None
    assert timeline.ranks == (0, 1, 2, 3, 4, 5)
    assert r.full_tensor().shape == (8, 2)
    for rank in (0, 1, 2, 3):
        compute = _spans(timeline, rank, "compute")
        assert [(s.name, s.kind) for s in compute] == [("matmul", "F"), ("add", "F")]
        (gather,) = _spans(timeline, rank, "comm")
        assert (gather.name, gather.kind, gather.track) == ("all_gather on [0, 1, 2, 3]", "COLL", "comm")
        assert compute[0].end <= gather.start  # the matmul ran before the reshard
    for rank in (4, 5):
        assert [(s.name, s.kind) for s in _spans(timeline, rank, "compute")] == [("add", "F"), ("sum", "B")]
        assert _spans(timeline, rank, "comm") == []
    # one process plays every rank: a collective is one interval on every member's lane
    assert len({(s.start, s.end) for rank in range(4) for s in _spans(timeline, rank, "comm")}) == 1
    assert timeline.meta["backend"] == "sim" and timeline.meta["dropped_spans"] == 0


def test_an_ops_compute_span_starts_after_its_input_reshard() -> None:
    backend = SimBackend(2)
    with dist.use_backend(backend):
        trace = MeasuredTrace(backend).start()
        try:
            mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
            a = dist.shard_tensor(np.ones((4, 4)), mesh, [dist.Shard(0)])
            b = dist.shard_tensor(np.ones((4, 4)), mesh, [dist.Shard(1)])
            dist.add(a, b)  # one input must be resharded first
        finally:
            trace.stop()
        timeline = trace.timeline()
    assert timeline is not None
    for rank in (0, 1):
        (add,) = _spans(timeline, rank, "compute")
        comm = _spans(timeline, rank, "comm")
        assert add.name == "add" and comm
        assert add.start >= max(s.end for s in comm)


def test_reference_mode_is_one_lane_without_communication() -> None:
    backend = ReferenceBackend(4)
    with dist.use_backend(backend):
        trace = MeasuredTrace(backend).start()
        try:
            mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
            x = dist.shard_tensor(np.ones((4, 2)), mesh, [dist.Shard(0)])
            dist.sum(dist.matmul(x, dist.to_tensor(np.ones((2, 3)))))
        finally:
            trace.stop()
        timeline = trace.timeline()
    assert timeline is not None and timeline.ranks == (0,)
    assert [s.name for s in timeline.lane(0)] == ["matmul", "sum"]


def test_recording_stops_and_untraced_calls_are_not_timed() -> None:
    backend = SimBackend(2)
    trace = MeasuredTrace(backend).start()
    trace.stop()
    assert (
        trace not in comm_module._span_recorders and trace not in hooks.op_hooks and trace not in hooks.op_start_hooks
    )
    assert comm_module._span_start() == 0.0


def test_trace_setting(tmp_path: Path) -> None:
    assert start_from_env(SimBackend(2), environ={}) is None
    with pytest.raises(
        ValueError, match=r"MPIPAR_TRACE='/no/such/dir/t.json': the folder '/no/such/dir' does not exist"
    ):
        start_from_env(SimBackend(2), environ={"MPIPAR_TRACE": "/no/such/dir/t.json"})
    assert measured.active() is None


# ---------------------------------------------------------------------- under mpiexec
ARGS = ("--mesh", "dp=2,tp=2", "--tiny", "--dtype", "float64", "--steps", "2")


def _check_lanes(timeline: Timeline, world: int) -> None:
    """Every lane: compute and comm spans in order (nesting only on compute), groups and peers plausible."""
    assert timeline.ranks == tuple(range(world))
    for rank in timeline.ranks:
        compute, comm = timeline.lane(rank, "compute"), timeline.lane(rank, "comm")
        assert compute and comm, f"rank {rank}: {len(compute)} compute and {len(comm)} comm spans"
        assert {s.kind for s in compute} == {"F", "B", "OPT"}
        for track, spans in (("compute", compute), ("comm", comm)):
            assert all(0 <= s.start <= s.end for s in spans)
            for a, b in itertools.pairwise(spans):
                assert b.start >= a.end or (track == "compute" and b.end <= a.end), f"rank {rank} {track}: {a} then {b}"
        for s in comm:
            m = GROUP.search(s.name)
            if m:
                members = [int(x) for x in m.group(1).split(", ")]
                assert s.kind == "COLL" and rank in members and len(set(members)) == len(members) >= 2, s
                assert set(members) <= set(range(world)), s
            else:
                assert re.fullmatch(r"(send to|recv from|exchange with) \d+(, \d+)*", s.name), s
                assert s.peer is None or (s.peer != rank and 0 <= s.peer < world), s
        # one thread per process: a compute span never overlaps a communication
        ends = sorted((s.start, s.end) for s in comm)
        for c in compute:
            assert not any(start < c.end and c.start < end for start, end in ends), f"rank {rank}: {c} overlaps comm"


def _losses(lines: list[str]) -> list[str]:
    return [m.group(0) for line in lines if (m := re.match(r"step \d+ loss \S+", line))]


@pytest.mark.mpi
def test_mpiexec_trace_has_the_simulators_spans_on_every_rank(tmp_path: Path) -> None:
    mpi_path, sim_path = tmp_path / "mpi.json", tmp_path / "sim.json"
    run = mpirun(4, "examples/gpt.py", *ARGS, env={"MPIPAR_TRACE": str(mpi_path)}, timeout=120)
    assert run.returncode == 0, run.output[-4000:]
    assert run.output.count("mpipar: wrote the measured timeline") == 1, run.output  # rank 0 only
    sim = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", "4", "examples/gpt.py", *ARGS],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), "MPIPAR_TRACE": str(sim_path)},
    )
    assert sim.returncode == 0, sim.stderr[-4000:]
    # The same losses: each `step <n> loss <v>` (the speed that follows it differs run to run).
    assert _losses(run.lines_of(0)) == _losses(sim.stdout.splitlines()) != []

    measured_tl, simulated_tl = Timeline.load(mpi_path), Timeline.load(sim_path)
    assert measured_tl.meta["backend"] == "mpi" and measured_tl.meta["world_size"] == 4
    assert measured_tl.meta["dropped_spans"] == 0
    _check_lanes(measured_tl, 4)
    _check_lanes(simulated_tl, 4)
    names = {s.name for s in measured_tl.spans}
    assert {"matmul", "softmax", "all_reduce(sum) on [0, 2]", "all_reduce(sum) on [0, 1]"} <= names
    for rank in range(4):  # same ops and collectives in the same order as the simulator's lane
        for track in TRACKS:
            got = [(s.name, s.kind, s.peer) for s in measured_tl.lane(rank, track)]
            assert got == [(s.name, s.kind, s.peer) for s in simulated_tl.lane(rank, track)], (rank, track)

    chrome = json.loads(json.dumps(measured_tl.to_chrome_trace()))
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(measured_tl.spans)
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    threads = {(e["pid"], e["args"]["name"]) for e in chrome["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == {(r, t) for r in range(4) for t in TRACKS}

    out = subprocess.run(
        [sys.executable, "-m", "mpipar.debug.measured", str(mpi_path), "--chrome", str(tmp_path / "trace.json")],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith(f"4 ranks, {len(measured_tl.spans)} spans")
    assert json.loads((tmp_path / "trace.json").read_text()) == chrome


@pytest.mark.mpi
def test_mpiexec_trace_has_a_lane_for_ranks_outside_every_mesh(tmp_path: Path) -> None:
    """seed_dp's mesh is ranks 0..3: under -n 6 ranks 4 and 5 compute nothing, and still get a lane."""
    path = tmp_path / "t.json"
    run = mpirun(
        6, "examples/paddle_auto/dp.py", "--tiny", "--steps", "1", env={"MPIPAR_TRACE": str(path)}, timeout=120
    )
    assert run.returncode == 0, run.output[-4000:]
    timeline = Timeline.load(path)
    assert timeline.ranks == tuple(range(6))
    for rank in range(4):
        assert [s.name for s in timeline.lane(rank, "compute")][:2] == ["matmul", "matmul"]
        assert any(s.name == "all_reduce(sum) on [0, 1, 2, 3]" for s in timeline.lane(rank, "comm"))
    for rank in (4, 5):
        assert timeline.lane(rank, "compute") == []
        for s in timeline.lane(rank, "comm"):  # e.g. float(loss) reaching every rank
            m = GROUP.search(s.name)
            assert m and rank in [int(x) for x in m.group(1).split(", ")], s


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
