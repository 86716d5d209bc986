"""When a captured program may run: no observer that must see every op, and, under MPI, every
rank agreeing on the path so that all run the same collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar import comm, hooks


def observed() -> str | None:
    """Why a captured program may not run now (observers that must see every op), or None."""

    if hooks.op_start_hooks or hooks.op_hooks or hooks.reshard_hooks or hooks.backward_hooks:
        return "observers (plan tracing, memory accounting, timelines) must see every op"
    if hooks.stage_runs:
        return "a pipeline stage run is in progress"
    if comm._span_recorders:
        return "a measured timeline records the step"
    return None


def agree(ok: Sequence[bool], backend: Any) -> list[bool]:
    """Under MPI (a process hosting part of the world) every flag is the minimum over all ranks,
    so that all processes take the same path (validation runs collectives)."""

    world = backend.world_group()
    mine = [r for r in world if backend.hosts(r)]
    if len(mine) == len(world) or not mine:
        return list(ok)
    saved = list(comm._recorders), list(comm._span_recorders)
    comm._recorders.clear()
    comm._span_recorders.clear()
    try:
        buf = np.array([1 if f else 0 for f in ok], dtype=np.int64)
        got = backend.comm.all_reduce(world, {mine[0]: buf}, "min")
    finally:
        comm._recorders[:] = saved[0]
        comm._span_recorders[:] = saved[1]
    return [bool(v) for v in next(iter(got.values()))]
