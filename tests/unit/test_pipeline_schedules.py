"""Pipeline schedules: unit-cost bubbles and in-flight bounds, tokens, golden grids, round trips.

Bubble fraction, as asserted here and defined in ``Timeline.bubble_fraction``: for a rank, the
share of the step (first span start to last span end, over all ranks) in which its compute track
is idle, ``(makespan - busy) / makespan``. With unit cost (F=1, B=2; ZBH1: B=1, W=1; free
communication) FThenB and 1F1B give every rank (p-1)/(m+p-1), interleaved 1F1B with v chunks
(p-1)/(v*m+p-1), and ZBH1 an idle time of (p-1)(tF+tB-tW) per rank.

    .venv/bin/python -m pytest tests/unit/test_pipeline_schedules.py -q
    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_pipeline_schedules.py -k golden   # rewrite grids
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpipar
from mpipar.pipeline import (
    ACTION_KINDS,
    Action,
    Schedule,
    build_schedule,
    dependencies,
    matching,
    parse_action,
    transfer_tag,
)
from mpipar.pipeline.lower import time_compute_orders
from simulator import simulate_schedule
from simulator.cost import PipelineCost, StageMemory

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "pipeline")
GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def _fraction(timeline: mpipar.debug.timeline.Timeline, rank: int) -> Fraction:
    # Unit-cost times are small integers in floats, so these Fractions are exact.
    return Fraction(timeline.bubble(rank)) / Fraction(timeline.makespan)


# ---------------------------------------------------------------------- unit-cost formulas
@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("kind", ["FThenB", "1F1B"])
def test_bubble_fraction_fthenb_1f1b(kind: str, p: int, m: int) -> None:
    timeline = simulate_schedule(build_schedule(kind, p, m), cost="unit")
    assert timeline.makespan == 3 * (m + p - 1)
    for rank in range(p):
        assert timeline.busy(rank) == 3 * m
        assert _fraction(timeline, rank) == Fraction(p - 1, m + p - 1)
    assert timeline.bubble_fraction() == pytest.approx(float(Fraction(p - 1, m + p - 1)), rel=1e-12)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("v", [2, 3])
def test_bubble_fraction_interleaved(p: int, m: int, v: int) -> None:
    schedule = build_schedule("Interleaved1F1B", p * v, m, num_chunks=v)
    assert schedule.num_ranks == p and schedule.num_chunks == v
    timeline = simulate_schedule(schedule)
    for rank in range(p):
        assert timeline.busy(rank) == 3 * v * m
        assert _fraction(timeline, rank) == Fraction(p - 1, v * m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_in_flight_1f1b_and_fthenb(p: int, m: int) -> None:
    assert build_schedule("1F1B", p, m).peak_in_flight() == {i: min(p - i, m) for i in range(p)}
    assert build_schedule("FThenB", p, m).peak_in_flight() == {i: m for i in range(p)}


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("kind", ["FThenB", "1F1B"])
def test_in_flight_seen_in_simulated_activation_memory(kind: str, p: int, m: int) -> None:
    """The same peaks, measured independently: activation bytes over time in the timeline."""
    memory = StageMemory.uniform(p, parameters=100.0, activations=1.0)
    timeline = simulate_schedule(build_schedule(kind, p, m), PipelineCost.uniform(p, memory=memory))
    assert timeline.memory is not None
    for stage in range(p):
        curve = timeline.memory[stage]
        want = min(p - stage, m) if kind == "1F1B" else m
        assert max(curve.bytes["activations"]) == want
        assert set(curve.bytes["parameters"]) == {100.0}
        assert curve.bytes["activations"][-1] == 0.0


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zbh1_bubble_time(p: int, m: int) -> None:
    schedule = build_schedule("ZBH1", p, m)
    assert schedule.split_backward
    timeline = simulate_schedule(schedule)
    for rank in range(p):
        assert timeline.bubble(rank) == (p - 1) * (1 + 1 - 1)
    assert schedule.peak_in_flight()[0] == min(p, m)  # stage 0 holds what 1F1B's does


@given(
    p=st.sampled_from([2, 3, 4, 8]),
    m_factor=st.sampled_from([1, 2, 4]),
    tw=st.integers(1, 8),
    extra_f=st.integers(0, 8),
    extra_b=st.integers(0, 8),
)
def test_zbh1_bubble_time_other_costs(p: int, m_factor: int, tw: int, extra_f: int, extra_b: int) -> None:
    """(p-1)(tF+tB-tW) holds whenever tW <= min(tF, tB) (times in quarters: exact in floats)."""
    tf, tb = tw + extra_f, tw + extra_b
    cost = PipelineCost.uniform(p, forward=tf / 4, backward_input=tb / 4, backward_weight=tw / 4)
    timeline = simulate_schedule(build_schedule("ZBH1", p, p * m_factor), cost)
    for rank in range(p):
        assert timeline.bubble(rank) == (p - 1) * (tf + tb - tw) / 4


# ---------------------------------------------------------------------- tokens
@pytest.mark.parametrize("kind", ACTION_KINDS)
def test_token_round_trip(kind: str) -> None:
    action = Action(kind, 12, 3)
    assert str(action) == f"12{kind}3"
    assert parse_action(str(action)) == action
    assert parse_action(f"  12{kind}3 ") == action
    assert action.span_kind == kind.split("_")[0]


@pytest.mark.parametrize("bad", ["F0", "0X1", "0F", "-1F0", "0SEND0", "0F1.5", ""])
def test_parse_action_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse pipeline action"):
        parse_action(bad)


def test_action_fields() -> None:
    with pytest.raises(ValueError, match="kind 'Q' is unknown"):
        Action("Q", 0, 0)
    with pytest.raises(ValueError, match="non-negative int stage"):
        Action("F", -1, 0)
    with pytest.raises(ValueError, match="has no peer"):
        Action("F", 0, 0, peer=1)
    recv = parse_action("1RECV_F0", peer=0)
    assert (recv.kind, recv.stage, recv.microbatch, recv.peer, recv.direction) == ("RECV_F", 1, 0, 0, "F")


def test_import_mpipar_exposes_pipeline() -> None:
    schedule = mpipar.pipeline.build_schedule("1F1B", 2, 2)
    assert [str(a) for a in schedule.actions[1]] == [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1B0",
        "1SEND_B0",
        "1F1",
        "1B1",
        "1SEND_B1",
    ]
    # Peers are filled in: rank 1's receives come from rank 0, its sends go there.
    assert {a.peer for a in schedule.actions[1] if a.is_comm} == {0}


@pytest.mark.parametrize("kind", ["1F1B", "Interleaved1F1B"])
def test_transfer_tags_pair_sends_with_receives(kind: str) -> None:
    chunks = 2 if kind == "Interleaved1F1B" else 1
    schedule = build_schedule(kind, 3 * chunks, 5, num_chunks=chunks)
    sends = {
        transfer_tag(a, schedule.num_stages): (r, a) for r, row in enumerate(schedule.actions) for a in row if a.is_send
    }
    recvs = {
        transfer_tag(a, schedule.num_stages): (r, a) for r, row in enumerate(schedule.actions) for a in row if a.is_recv
    }
    assert sends.keys() == recvs.keys()
    assert len(sends) == sum(a.is_send for row in schedule.actions for a in row)  # unique per transfer
    for tag, (src, send) in sends.items():
        dst, recv = recvs[tag]
        assert (send.peer, recv.peer) == (dst, src)
        assert matching(send).key == recv.key
    with pytest.raises(ValueError, match="0F0 is not a send or receive"):
        transfer_tag(parse_action("0F0"), 3)


def test_interleaved_stage_placement() -> None:
    schedule = build_schedule("Interleaved1F1B", 8, 4, num_chunks=2)
    for rank, row in enumerate(schedule.actions):
        assert {a.stage for a in row} == {rank, rank + 4}
        for action in row:
            if action.is_comm:
                other = action.stage + (1 if action.kind in ("SEND_F", "RECV_B") else -1)
                assert action.peer == other % 4
    assert schedule.stages_of(1) == [1, 5]


# ---------------------------------------------------------------------- every schedule, checked independently
KINDS = st.sampled_from(["FThenB", "1F1B", "Interleaved1F1B", "ZBH1"])


@given(kind=KINDS, p=st.integers(1, 6), m=st.integers(1, 13), v=st.integers(1, 3))
def test_built_schedules_are_sound(kind: str, p: int, m: int, v: int) -> None:
    chunks = v if kind == "Interleaved1F1B" else 1
    schedule = build_schedule(kind, p * chunks, m, num_chunks=chunks)
    split = kind == "ZBH1"
    # Every compute action exactly once, on the rank owning its stage.
    seen = [(a.kind, a.stage, a.microbatch) for row in schedule.actions for a in row if a.is_compute]
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert sorted(seen) == sorted((k, s, mb) for k in kinds for s in range(p * chunks) for mb in range(m))
    for rank, row in enumerate(schedule.actions):
        assert all(a.stage % p == rank for a in row)
    # The rendezvous dry run's execution order runs every input before its consumer.
    done: set[tuple[str, int, int]] = set()
    for rank, index in schedule.validate("rendezvous").order:
        action = schedule.actions[rank][index]
        if action.is_compute:
            assert all(d.key in done for d in dependencies(action, schedule.num_stages, split)), action
            done.add(action.key)
    for semantics in ("eager", "nonblocking"):
        schedule.validate(semantics)
    # Round trips.
    assert Schedule.from_csv(schedule.to_csv(), kind=kind) == schedule
    assert Schedule.from_dict(json.loads(json.dumps(schedule.to_dict()))) == schedule
    # The simulator's compute spans equal the lowering pass's independent earliest-start timing.
    timeline = simulate_schedule(schedule)
    orders = tuple(tuple(r) for r in schedule.compute_orders())
    times = time_compute_orders(orders, schedule.num_stages, split)
    for rank in range(p):
        spans = timeline.lane(rank, "compute")
        want = sorted((float(s), float(e)) for s, e in times[rank])
        assert sorted((s.start, s.end) for s in spans) == want


def test_build_schedule_errors() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule kind 'ZBH2'; use one of FThenB, 1F1B"):
        build_schedule("ZBH2", 4, 4)
    with pytest.raises(ValueError, match="num_chunks=2 needs virtual stages; use 'Interleaved1F1B'"):
        build_schedule("1F1B", 4, 4, num_chunks=2)
    with pytest.raises(ValueError, match=r"num_stages \(6\) = ranks x num_chunks \(4\)"):
        build_schedule("Interleaved1F1B", 6, 4, num_chunks=4)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int, got 0"):
        build_schedule("1F1B", 4, 0)
    with pytest.raises(ValueError, match="num_stages must be a positive int, got True"):
        build_schedule("1F1B", True, 4)
    with pytest.raises(TypeError, match="schedule kind must be a string"):
        build_schedule(3, 4, 4)  # type: ignore[arg-type]
    assert build_schedule("gpipe", 2, 2) == build_schedule("FThenB", 2, 2)


def test_single_rank_has_no_communication() -> None:
    schedule = build_schedule("Interleaved1F1B", 3, 2, num_chunks=3)
    assert schedule.num_ranks == 1
    assert not any(a.is_comm for a in schedule.actions[0])
    assert simulate_schedule(schedule).bubble(0) == 0


# ---------------------------------------------------------------------- golden grids
GOLDEN = {
    "FThenB_p4_m8.txt": lambda: build_schedule("FThenB", 4, 8).grid(),
    "1F1B_p4_m8.txt": lambda: build_schedule("1F1B", 4, 8).grid(),
    "Interleaved1F1B_p4_v2_m8.txt": lambda: build_schedule("Interleaved1F1B", 8, 8, num_chunks=2).grid(),
    "ZBH1_p4_m8.txt": lambda: build_schedule("ZBH1", 4, 8).grid(),
    "1F1B_p2_m3_comm.txt": lambda: build_schedule("1F1B", 2, 3).grid(comm=True),
    "1F1B_p2_m3.csv": lambda: build_schedule("1F1B", 2, 3).to_csv(),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name: str) -> None:
    """Grids print stably; a behaviour change shows up in review. UPDATE_GOLDEN=1 rewrites."""
    text = GOLDEN[name]()
    path = os.path.join(GOLDEN_DIR, name)
    if os.environ.get("UPDATE_GOLDEN"):
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    with open(path, encoding="utf-8") as f:
        assert text == f.read()


def test_grid_shape_matches_dry_run() -> None:
    """The 1F1B grid is the textbook picture: rank i starts at step i, finishes at 2(m+p-1)-1-i."""
    p, m = 4, 8
    lines = build_schedule("1F1B", p, m).grid().splitlines()[2:]
    assert len(lines) == 2 * (m + p - 1)
    columns = [line.split()[1:] for line in lines]
    for rank in range(p):
        busy = [step for step, row in enumerate(columns) if row[rank] != "."]
        assert busy[0] == rank
        assert len(busy) == 2 * m
        assert busy[-1] == 2 * (m + p - 1) - 1 - rank
