"""The search's compiled pipeline simulation (``simulator.fast_pipeline``) gives the event
simulation's numbers bit for bit, for every schedule kind, uneven costs and transfers."""

from __future__ import annotations

import random

import pytest

from mpipar.pipeline import build_schedule
from simulator.cost import PipelineCost
from simulator.estimate import _peak_in_flight_bytes
from simulator.fast_pipeline import compile_schedule
from simulator.schedule_sim import _Run

CASES = [("FThenB", 4, 6, 1), ("1F1B", 4, 9, 1), ("1F1B", 1, 3, 1), ("ZBH1", 4, 7, 1),
         ("Interleaved1F1B", 8, 8, 2), ("Interleaved1F1B", 12, 9, 4)]


@pytest.mark.parametrize("kind,stages,micro,chunks", CASES, ids=lambda c: str(c))
def test_compiled_pipeline_equals_event_simulation(kind: str, stages: int, micro: int, chunks: int) -> None:
    rng = random.Random(stages * 100 + micro)
    for trial in range(3):
        def times(n: int) -> tuple[float, ...]:
            return tuple(rng.uniform(0.1, 3.0) for _ in range(n))

        # Trial 0: zero transfers and zero weight time, where ties between inputs are everywhere.
        zero = trial == 0
        cost = PipelineCost(times(stages), times(stages), (0.0,) * stages if zero else times(stages),
                            (0.0,) * (stages - 1) if zero else times(stages - 1),
                            (0.0,) * (stages - 1) if zero else times(stages - 1), "s")
        act = tuple(rng.randrange(1, 1 << 30) for _ in range(stages))
        schedule = build_schedule(kind, stages, micro, chunks)
        timeline = _Run(schedule, cost).timeline()
        got = compile_schedule(kind, stages, micro, chunks).run(cost, act)
        lanes = schedule.num_ranks
        assert got.ends == tuple(max((s.end for s in timeline.lane(k, "compute")), default=0.0) for k in range(lanes))
        assert got.makespan == timeline.makespan
        assert got.busy == sum(timeline.busy(r) for r in timeline.ranks)
        assert got.in_flight == tuple(
            _peak_in_flight_bytes(schedule, k, {s: act[s] for s in schedule.stages_of(k)}) for k in range(lanes))


def test_cost_of_another_stage_count_is_refused() -> None:
    with pytest.raises(ValueError, match="stages"):
        compile_schedule("1F1B", 4, 4, 1).run(PipelineCost.unit(2), (1, 1))
