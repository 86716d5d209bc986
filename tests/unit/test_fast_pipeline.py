"""The search's compiled pipeline simulation (``simulator.fast_pipeline``) gives the event
simulation's numbers bit for bit, for every schedule kind, uneven costs and transfers, posted
or blocking (rendezvous) hand-offs; the
memory bound built on its activation walk never exceeds the priced peak."""

from __future__ import annotations

import random

import pytest

from mpipar.pipeline import build_schedule
from simulator.cost import PipelineCost, load_profile
from simulator.estimate import _peak_in_flight_bytes
from simulator.fast_estimate import TraceCache, layer_counts, peak_lower_bound, stage_parts
from simulator.fast_pipeline import compile_schedule, lane_flight_events
from simulator.schedule_sim import _Run
from simulator.search import state_lower_bound, state_per_layer_lower_bound
from simulator.step_trace import GPTShape, GPTStrategy

CASES = [
    ("FThenB", 4, 6, 1),
    ("1F1B", 4, 9, 1),
    ("1F1B", 1, 3, 1),
    ("ZBH1", 4, 7, 1),
    ("Interleaved1F1B", 8, 8, 2),
    ("Interleaved1F1B", 12, 9, 4),
]


@pytest.mark.parametrize("blocking", [False, True], ids=["posted", "blocking"])
@pytest.mark.parametrize("kind,stages,micro,chunks", CASES, ids=lambda c: str(c))
def test_compiled_pipeline_equals_event_simulation(
    kind: str, stages: int, micro: int, chunks: int, blocking: bool
) -> None:
    rng = random.Random(stages * 100 + micro)
    for trial in range(3):

        def times(n: int) -> tuple[float, ...]:
            return tuple(rng.uniform(0.1, 3.0) for _ in range(n))

        # Trial 0: zero transfers and zero weight time, where ties between inputs are everywhere.
        zero = trial == 0
        cost = PipelineCost(
            times(stages),
            times(stages),
            (0.0,) * stages if zero else times(stages),
            (0.0,) * (stages - 1) if zero else times(stages - 1),
            (0.0,) * (stages - 1) if zero else times(stages - 1),
            "s",
            blocking_transfers=blocking,
        )
        act = tuple(rng.randrange(1, 1 << 30) for _ in range(stages))
        schedule = build_schedule(kind, stages, micro, chunks)
        timeline = _Run(schedule, cost).timeline()
        got = compile_schedule(kind, stages, micro, chunks, blocking).run(cost, act)
        lanes = schedule.num_ranks
        assert got.ends == tuple(max((s.end for s in timeline.lane(k, "compute")), default=0.0) for k in range(lanes))
        assert got.makespan == timeline.makespan
        assert got.busy == sum(timeline.busy(r) for r in timeline.ranks)
        assert got.in_flight == tuple(
            _peak_in_flight_bytes(schedule, k, {s: act[s] for s in schedule.stages_of(k)}) for k in range(lanes)
        )


def test_cost_of_another_stage_count_is_refused() -> None:
    with pytest.raises(ValueError, match="stages"):
        compile_schedule("1F1B", 4, 4, 1).run(PipelineCost.unit(2), (1, 1))


@pytest.mark.parametrize("kind,stages,micro,chunks", CASES, ids=lambda c: str(c))
def test_flight_from_compute_orders_equals_the_schedules(kind: str, stages: int, micro: int, chunks: int) -> None:
    assert lane_flight_events(kind, stages, micro, chunks) == compile_schedule(kind, stages, micro, chunks).flight


HW = load_profile("a100-nvlink-ib")
SHAPE = GPTShape(16, 128, 8, seq=64, vocab=256)
BOUND_CASES = [
    (1, GPTStrategy(2, 2, 2, True, "selective", 1, True, "adamw", 12, "1F1B", 1)),  # extrapolated
    (2, GPTStrategy(1, 4, 4, True, "none", 0, True, "adamw", 16, "Interleaved1F1B", 2)),  # walked whole
    (1, GPTStrategy(2, 2, 2, False, "none", 3, True, "adamw", 24, "Interleaved1F1B", 4)),  # extrapolated
    (1, GPTStrategy(4, 1, 2, False, "full", 2, True, "adamw", 3, "ZBH1", 1)),
    (1, GPTStrategy(2, 2, 4, True, "none", 0, True, "adamw", 6, "FThenB", 1)),
]


@pytest.mark.parametrize(
    "mbs,strategy",
    BOUND_CASES,
    ids=lambda c: (
        str(c)
        if isinstance(c, int)
        else f"dp{c.dp}-tp{c.tp}-pp{c.pp}-{c.schedule}-c{c.chunks}-z{c.zero}-{c.recompute}-m{c.micro_batches}"
    ),
)
def test_peak_bound_never_exceeds_the_priced_peak(mbs: int, strategy: GPTStrategy) -> None:
    shape = GPTShape(SHAPE.layers, SHAPE.hidden, SHAPE.heads, SHAPE.seq, SHAPE.vocab, mbs)
    cache = TraceCache(HW)
    priced = cache.estimate(shape, strategy)
    assert priced is not None
    counts = layer_counts(shape.layers, strategy.pp, strategy.chunks)
    per_layer = state_per_layer_lower_bound(shape, strategy)
    bound = peak_lower_bound(strategy, counts, cache.invariant(shape, strategy), per_layer)
    assert 0 < bound <= priced.peak_bytes
    # Interleaved warm-ups hold more than pp micro-batches of the first stage: tighter than the first bound.
    if strategy.chunks > 1:
        parts = stage_parts(strategy, counts)
        act = sum(k * cache.invariant(shape, strategy).activations.get(p, 0) for p, k in parts[0])
        assert bound > state_lower_bound(shape, strategy) + act * min(strategy.micro_batches, strategy.pp)


def test_too_long_a_step_is_not_walked() -> None:
    assert lane_flight_events("1F1B", 32, 1536, 1) is None
