"""Pipeline parallelism: schedule kinds as per-rank action lists, validated, shown and exported.

    import mpipar
    s = mpipar.pipeline.build_schedule("1F1B", num_stages=4, num_microbatches=8)
    s.actions[1]          # rank 1's actions: 1RECV_F0, 1F0, 1SEND_F0, ...
    print(s.grid())       # step x rank text grid
    s.validate()          # dry run; raises ScheduleDeadlock naming the rank and action
    s.to_csv()

``python -m simulator schedule 1F1B -p 4 -m 8`` prints the grid and the simulated timeline's
bubble; ``simulator.simulate_schedule(s)`` gives the timeline.
"""

from mpipar.pipeline.actions import (
    ACTION_KINDS,
    ACTION_SPAN_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    Blocked,
    ScheduleDeadlock,
    ScheduleError,
    dependencies,
    matching,
    parse_action,
    transfer_tag,
)
from mpipar.pipeline.schedule import KINDS, Schedule, build_schedule, resolve_kind
from mpipar.pipeline.stages import stage_layer_counts, stage_of_layers
from mpipar.pipeline.validate import DryRun, stage_rank


def validate(schedule: Schedule, semantics: str = "rendezvous") -> DryRun:
    """Dry-run ``schedule``; raise ``ScheduleDeadlock`` naming the rank and action that can never run."""
    return schedule.validate(semantics)


__all__ = [
    "ACTION_KINDS",
    "ACTION_SPAN_KINDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KINDS",
    "Action",
    "Blocked",
    "DryRun",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "build_schedule",
    "dependencies",
    "matching",
    "parse_action",
    "resolve_kind",
    "stage_layer_counts",
    "stage_of_layers",
    "stage_rank",
    "transfer_tag",
    "validate",
]
