"""Pipeline timelines from a plan's ``pipeline`` and ``memory`` sections, for any schedule kind.

The dashboard re-simulates a plan to show another schedule beside the loaded one, or the
memory curve of one chosen rank. What it reads (every key optional except ``stages``):

    "pipeline": {"stages": [{"stage": 0, "mesh": 0, "rank": 0}, ...],   # rank = pipeline lane
                 "num_microbatches": 4,
                 "schedule": Schedule.to_dict(),
                 "cost": {"time_unit": "s", "forward": [...], "backward_input": [...],
                          "backward_weight": [...], "send_forward": [...], "send_backward": [...]},
                 "step_end": {"0": [{"name": "grad all_reduce", "kind": "COLL", "track": "comm",
                                     "duration": 1e-4}, ...]}}        # after the flush, per lane
    "memory":   {"capacity_bytes": 85520809984,
                 "ranks": [{"rank": 0, "parameters": ..., "gradients": ..., "optimizer_state": ...,
                            "activations": {"0": bytes per micro-batch of stage 0, ...},
                            "messages": {"0": bytes of one stage 0 -> 1 message, ...}}]}

Without ``cost`` the unit cost is used (F 1, B 2, communication free). A rank's memory curve
is the simulator's (model state all step, a stage's activations from the start of a
micro-batch's forward to the end of its last backward action, messages while in transit),
fed with that rank's own bytes; the lane shows the ranks of its stage mesh.

    timeline = simulate_plan(plan, kind="ZBH1")          # same stages, another schedule
    timeline = simulate_plan(plan, memory_rank=5)        # lane of rank 5 carries rank 5's memory
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import MemoryCurve, Span, Timeline
from mpipar.pipeline import KINDS, Schedule, build_schedule, resolve_kind
from simulator import simulate_schedule
from simulator.cost import PipelineCost, StageMemory
from viz.planinfo import stage_meshes


class NoPipeline(ValueError):
    """The plan has no pipeline section to simulate."""


def num_stages(plan: Plan) -> int:
    return len(stage_meshes(plan))


def num_lanes(plan: Plan) -> int:
    """Pipeline ranks (lanes): stages dealt round-robin, so the number of distinct stage meshes."""
    stages = stage_meshes(plan)
    return len(set(stages.values())) if stages else 0


def lane_ranks(plan: Plan) -> dict[int, list[int]]:
    """``{lane: global ranks of its stage mesh}``."""
    stages = stage_meshes(plan)
    lanes = num_lanes(plan)
    out: dict[int, list[int]] = {}
    for s, mid in sorted(stages.items()):
        out.setdefault(s % lanes, list(plan.mesh(mid).process_ids))
    return out


def plan_microbatches(plan: Plan) -> int:
    pipe = plan.pipeline or {}
    m = pipe.get("num_microbatches") or (pipe.get("schedule") or {}).get("num_microbatches")
    return int(m) if isinstance(m, int) and m > 0 else 1


def plan_kind(plan: Plan) -> str:
    kind = ((plan.pipeline or {}).get("schedule") or {}).get("kind", "1F1B")
    try:
        return resolve_kind(str(kind)).name
    except ValueError:
        return "1F1B"


def compatible_kinds(plan: Plan) -> list[str]:
    """Schedule kinds that fit the plan's stages: one stage per lane, or several (interleaved)."""
    stages, lanes = num_stages(plan), num_lanes(plan)
    if not stages:
        return []
    if stages == lanes:
        return [k for k, spec in KINDS.items() if not spec.virtual_stages] + ["Interleaved1F1B"]
    return [k for k, spec in KINDS.items() if spec.virtual_stages]


def plan_schedule(plan: Plan, kind: str | None = None, microbatches: int | None = None) -> Schedule:
    """The plan's schedule, or another kind / micro-batch count over the same stages."""
    if not plan.pipeline or not stage_meshes(plan):
        raise NoPipeline("this plan has no pipeline section (pipeline.stages); it runs as one stage")
    pipe_sched = plan.pipeline.get("schedule")
    if kind is None and microbatches is None and isinstance(pipe_sched, Mapping):
        return Schedule.from_dict(pipe_sched)
    stages, lanes = num_stages(plan), num_lanes(plan)
    return build_schedule(
        kind or plan_kind(plan), stages, microbatches or plan_microbatches(plan), stages // lanes if lanes else 1
    )


def _floats(value: Any, count: int, default: float) -> tuple[float, ...]:
    if isinstance(value, list) and len(value) == count and all(isinstance(v, int | float) and v >= 0 for v in value):
        return tuple(float(v) for v in value)
    return (default,) * count


def rank_memory(plan: Plan, rank: int) -> Mapping[str, Any] | None:
    for item in (plan.memory or {}).get("ranks", []) or []:
        if isinstance(item, Mapping) and item.get("rank") == rank:
            return item
    return None


def capacity_bytes(plan: Plan) -> int | None:
    cap = (plan.memory or {}).get("capacity_bytes")
    return int(cap) if isinstance(cap, int | float) and cap > 0 else None


def _stage_memory(plan: Plan, rank: int, stages: int) -> StageMemory | None:
    """Stage bytes as ``rank`` sees them: its own stages carry its numbers, other stages zero."""
    mem = rank_memory(plan, rank)
    if mem is None:
        return None
    own = [s for s, mid in stage_meshes(plan).items() if rank in plan.mesh(mid).process_ids]
    share = max(len(own), 1)

    def per_stage(key: str) -> list[float]:
        value = float(mem.get(key, 0.0) or 0.0)
        return [value / share if s in own else 0.0 for s in range(stages)]

    acts = mem.get("activations") or {}
    msgs = mem.get("messages") or {}
    activations = [float(acts.get(str(s), 0.0)) if s in own else 0.0 for s in range(stages)]
    messages = [float(msgs.get(str(s), 0.0)) for s in range(stages - 1)]
    return StageMemory(
        tuple(per_stage("parameters")),
        tuple(per_stage("gradients")),
        tuple(per_stage("optimizer_state")),
        tuple(activations),
        tuple(messages),
        tuple(messages),
    )


def plan_cost(plan: Plan, memory_rank: int | None = None, stages: int | None = None) -> PipelineCost:
    n = stages if stages is not None else num_stages(plan)
    cost = (plan.pipeline or {}).get("cost") or {}
    unit = cost.get("time_unit", "unit") if isinstance(cost, Mapping) else "unit"
    memory = _stage_memory(plan, memory_rank, n) if memory_rank is not None else None
    if not isinstance(cost, Mapping) or "forward" not in cost:
        base = PipelineCost.unit(n)
        return PipelineCost(
            base.forward,
            base.backward_input,
            base.backward_weight,
            base.send_forward,
            base.send_backward,
            "unit",
            memory,
        )
    return PipelineCost(
        _floats(cost.get("forward"), n, 1.0),
        _floats(cost.get("backward_input"), n, 1.0),
        _floats(cost.get("backward_weight"), n, 1.0),
        _floats(cost.get("send_forward"), n - 1, 0.0),
        _floats(cost.get("send_backward"), n - 1, 0.0),
        unit if unit in ("s", "unit") else "unit",
        memory,
        cost.get("blocking_transfers") is True,
    )


def simulate_plan(
    plan: Plan, kind: str | None = None, microbatches: int | None = None, memory_rank: int | None = None
) -> Timeline:
    """The plan's pipeline simulated (another ``kind``/``microbatches`` if given), step-end spans appended."""
    schedule = plan_schedule(plan, kind, microbatches)
    timeline = simulate_schedule(schedule, plan_cost(plan, memory_rank, schedule.num_stages))
    spans = list(timeline.spans)
    ends = {r: max((s.end for s in timeline.lane(r)), default=0.0) for r in timeline.ranks}
    step_end = (plan.pipeline or {}).get("step_end") or {}
    for lane in timeline.ranks:
        t = ends[lane]
        for item in step_end.get(str(lane), []) if isinstance(step_end, Mapping) else []:
            dur = float(item.get("duration", 0.0))
            spans.append(
                Span(
                    lane,
                    str(item.get("name", "step end")),
                    str(item.get("kind", "OTHER")),
                    None,
                    None,
                    t,
                    t + dur,
                    str(item.get("track", "compute")),
                )
            )
            t += dur
    memory: list[MemoryCurve] | None = list(timeline.memory.values()) if timeline.memory else None
    meta = {**timeline.meta, "lane_ranks": {str(k): v for k, v in lane_ranks(plan).items()}}
    if memory_rank is not None:
        meta["memory_rank"] = memory_rank
    return Timeline(spans, ranks=timeline.ranks, memory=memory, time_unit=timeline.time_unit, meta=meta)


def lane_of_rank(plan: Plan, rank: int) -> int | None:
    for lane, ranks in lane_ranks(plan).items():
        if rank in ranks:
            return lane
    return None


def heaviest_rank(plan: Plan, lane: int) -> int | None:
    """The rank of a lane with the most bytes (model state plus one micro-batch of each stage)."""
    best: tuple[float, int] | None = None
    for rank in lane_ranks(plan).get(lane, []):
        mem = rank_memory(plan, rank)
        if mem is None:
            continue
        total = sum(float(mem.get(k, 0.0) or 0.0) for k in ("parameters", "gradients", "optimizer_state"))
        total += sum(float(v) for v in (mem.get("activations") or {}).values())
        if best is None or total > best[0]:
            best = (total, rank)
    return None if best is None else best[1]


def simulate_plan_lanes(plan: Plan, kind: str | None = None, microbatches: int | None = None) -> Timeline:
    """``simulate_plan`` with each lane's memory curve taken from that lane's heaviest rank."""
    base = simulate_plan(plan, kind, microbatches)
    curves: list[MemoryCurve] = []
    chosen: dict[str, int] = {}
    for lane in base.ranks:
        rank = heaviest_rank(plan, lane)
        if rank is None:
            continue
        t = simulate_plan(plan, kind, microbatches, memory_rank=rank)
        if t.memory and lane in t.memory:
            curves.append(t.memory[lane])
            chosen[str(lane)] = rank
    if not curves or len(curves) != len(base.ranks):
        return base
    return Timeline(
        base.spans,
        ranks=base.ranks,
        memory=curves,
        time_unit=base.time_unit,
        meta={**base.meta, "memory_ranks": chosen},
    )
