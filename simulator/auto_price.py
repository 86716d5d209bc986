"""The default pricer of ``mpipar.auto_shard``: one traced step -> (seconds, bytes) per rank.

mpipar never imports the simulator; it finds this function through the ``mpipar.pricers``
entry point (``pyproject.toml``), as it finds the simulator's backends.

Seconds: each rank runs its ops and its reshards one after another (``op_cost.PlanCosts`` on
the profile: matmul FLOPs on the local shards, the GPU model's memory roofline and launches,
each collective from ``HardwareProfile.collective_time``), then updates the parameter elements
it holds with AdamW (the shape-only trace records no update ops, so they are priced here as
``estimate`` prices them: ``UPDATE_FLOPS`` per element, or streaming param, gradient and two
moments in and param and moments out, whichever is slower); the step takes as long as its
slowest rank. A replicated parameter is updated whole on every rank: that is what splitting
it saves. Bytes: the planner's bytes per rank of every reshard of the plan (all phases).
"""

from __future__ import annotations

import functools
from collections import defaultdict

from mpipar.compile.plan import Plan
from simulator.cost import HardwareProfile, load_profile
from simulator.op_cost import PlanCosts, itemsize

DEFAULT_HARDWARE = "a100-nvlink-ib"
UPDATE_FLOPS = 14.0
"""FLOPs per element of one AdamW update (the figure ``simulator.estimate`` uses)."""
UPDATE_STREAMS = 7
"""Arrays an AdamW update streams per element: reads param, grad, two moments; writes param, two moments."""


def price_plan(plan: Plan, hardware: str | HardwareProfile | None = None) -> tuple[float, float]:
    """``(step seconds on the slowest rank, communicated bytes per rank)`` of ``plan``."""
    profile = hardware if isinstance(hardware, HardwareProfile) else _profile(hardware or DEFAULT_HARDWARE)
    costs = PlanCosts(plan, profile)
    per_rank: defaultdict[int, float] = defaultdict(float)
    for op in plan.ops:
        _add(per_rank, costs.op_times(op), costs.op_ranks(op))
    for r in plan.reshards:
        _add(per_rank, costs.reshard_times(r), costs.reshard_ranks(r))
    seen: set[str] = set()
    for t in plan.tensors:
        if t.kind != "parameter" or t.mesh is None or t.name in seen:
            continue
        seen.add(t.name)
        for rank in plan.mesh(t.mesh).process_ids:
            n = 1
            for d in costs.local_shape(t.id, None, rank):
                n *= d
            seconds = costs.compute_time(n * UPDATE_FLOPS, "float32")
            if profile.memory_Bps:
                seconds = max(seconds, n * UPDATE_STREAMS * itemsize(t.dtype) / profile.memory_Bps)
            per_rank[rank] += seconds
    comm = float(sum(r.bytes_per_rank for r in plan.reshards))
    return max(per_rank.values(), default=0.0), comm


@functools.lru_cache(maxsize=16)
def _profile(name: str) -> HardwareProfile:
    """A preset or profile file, read once per process (auto_shard prices a hundred traces)."""
    return load_profile(name)


def _add(per_rank: defaultdict[int, float], times: float | dict[int, float], ranks: tuple[int, ...]) -> None:
    if isinstance(times, dict):
        for rank, t in times.items():
            per_rank[rank] += t
    else:
        for rank in ranks:
            per_rank[rank] += times
