"""Time for any plan: price a plan's ops and reshards on a hardware profile, in seconds.

A plan written by ``mpipar plan`` records what one micro-batch of each stage runs (ops,
reshards, the pipeline schedule) but no time: its pipeline view was drawn in "time units"
(F = 1, B = 2). This module prices it with the simulator's cost model, never a pricing of its
own: ``simulator.op_cost.PlanCosts`` gives each op's and each reshard's seconds on each rank
(matmul FLOPs on the local shards, roofline and kernel launches on a GPU profile,
``HardwareProfile.collective_time``/``p2p_time`` for collectives and transfers). From those:

* ``forward[s]`` / ``backward[s]``: per stage, the busiest rank of the stage's mesh summed
  over the stage's forward (backward) ops and the reshards they inserted on that mesh. An op's
  stage is ``viz.planinfo.stage_of`` (its scope, else its output's mesh); a reshard inserted
  by an op follows the op, one inserted by autograd (``op`` null) follows its mesh; when a
  mesh holds several stages (interleaved) and nothing names one, the time is shared evenly.
* ``backward_weight[s]``: the part of ``backward[s]`` in weight-gradient matmuls (a backward
  matmul whose output is a gradient tensor, or ``x^T @ dy`` whose last two dims have the
  shape of a parameter on its mesh: a per-sample weight gradient),
  which zero-bubble schedules run apart as ``W``; other schedules charge ``B + W`` as one.
* ``send_forward[s]`` / ``send_backward[s]``: a reshard between two meshes (a pipeline
  hand-off), its busiest rank's steps (collectives and point-to-point transfers).
* ``step_end``: once per step on each lane after its last backward, as ``simulator.estimate``
  and the sample price it (a runtime accumulating micro-batches locally): the gradient
  synchronisation (the reshards autograd inserts to bring a parameter's gradient to its layout,
  ``reason`` "gradient of DistTensor 'name' ..." or a tensor of kind gradient; COLL on the comm
  track), then the optimizer's ops (OPT, compute track) and its reshards (COLL). On a profile
  that prices mpipar's own eager runtime (``HardwareProfile.prices_eager_runtime``: a
  calibrated CPU profile) the gradient synchronisation is instead part of every micro-batch's
  backward weight part, where that runtime runs it, and hand-offs block both ranks
  (``cost.blocking_transfers``), as ``simulator.estimate`` prices them there.

``priced(plan, profile)`` returns a copy of the plan whose ``pipeline.cost`` holds these
seconds (``time_unit: "s"``), so ``viz.simulate`` (pipeline and memory views) draws seconds.
A plan without a pipeline section (an eager script's) is priced as one stage holding the
whole step (``one_step_pipeline``).

    plan = priced(Plan.load("plan.json"), load_profile("h100-nvlink-ib"))
    simulate_plan(plan).makespan                       # predicted step, seconds
    profile = profile_from_bytes(data, "mine.json")    # an uploaded profile, validated
    lanes = measured_on_lanes(measured, predicted)     # MPIPAR_TRACE's ranks -> the pipeline lanes
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mpipar.compile.plan import Plan, PlanOp, PlanReshard
from mpipar.debug.timeline import Timeline
from mpipar.pipeline import build_schedule
from mpipar.untrusted import MEMORY_FACTOR, FileFormatError, parse_json, read_bounded
from simulator.cost import HardwareProfile
from simulator.op_cost import PlanCosts
from viz.planinfo import stage_meshes, stage_of

MAX_PROFILE_BYTES = 1 << 20
"""A hardware profile is a few hundred bytes; larger files are refused before parsing."""
PHASES = ("forward", "backward")
ONE_STEP = "one_step"
"""``pipeline.one_step``: the section ``priced`` writes for a plan that had none (one stage, every mesh)."""


class ProfileError(ValueError):
    """A hardware profile the dashboard cannot use; the message names the file, field and value."""


@dataclass(frozen=True)
class StagePrices:
    """Seconds per stage (one micro-batch, busiest rank of the stage) and per lane (once per step)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_weight: tuple[float, ...]
    send_forward: tuple[float, ...]
    send_backward: tuple[float, ...]
    grad_sync: dict[int, float]
    """Per lane: the parameters' gradient reshards (data-parallel all-reduce, ...), once per step."""
    optimizer: dict[int, float]
    """Per lane: optimizer ops on the busiest rank of the lane."""
    optimizer_comm: dict[int, float]
    """Per lane: optimizer-phase reshards (a ZeRO all-gather of the updated parameters)."""
    profile: str
    eager_runtime: bool = False
    """The profile prices mpipar's eager runtime (``HardwareProfile.prices_eager_runtime``): each
    micro-batch's gradient sync is in its stage's backward (``W``), ``grad_sync`` is empty, and
    hand-offs hold both ranks until done (``cost.blocking_transfers``)."""


class _Ledger:
    """Seconds per rank, kept as one number per group of ranks where every rank pays the same."""

    def __init__(self) -> None:
        self.shared: dict[tuple[int, ...], float] = {}
        self.own: dict[int, float] = {}

    def add(self, ranks: tuple[int, ...], value: float | dict[int, float], share: float = 1.0) -> None:
        if isinstance(value, dict):
            for r, v in value.items():
                self.own[r] = self.own.get(r, 0.0) + v * share
        elif ranks:
            self.shared[ranks] = self.shared.get(ranks, 0.0) + value * share

    def most(self) -> float:
        """The busiest rank's total."""
        ranks = set(self.own)
        for group in self.shared:
            ranks.update(group)
        if not ranks:
            return 0.0
        members = {g: frozenset(g) for g in self.shared}
        return max(self.own.get(r, 0.0) + sum(v for g, v in self.shared.items() if r in members[g]) for r in ranks)


def _mesh_stages(plan: Plan) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for s, mid in sorted(stage_meshes(plan).items()):
        out.setdefault(mid, []).append(s)
    return out


def _num_lanes(plan: Plan) -> int:
    return len(set(stage_meshes(plan).values()))


def _weight_op(plan: Plan, op: PlanOp, param_shapes: set[tuple[int | None, tuple[int, ...]]]) -> bool:
    """A weight-gradient matmul: its output is a gradient tensor, or it is ``x^T @ dy`` (its first
    operand contracted on its second-to-last dim) with a parameter's shape in its last two dims
    (a per-sample weight gradient, summed over the batch after)."""
    if op.phase != "backward" or op.op != "matmul" or not op.outputs or not op.inputs:
        return False
    out = plan.tensor(op.outputs[0])
    if out.kind == "gradient":
        return True
    x = plan.tensor(op.inputs[0]).shape
    transposed = len(x) >= 2 and len(out.shape) >= 2 and x[-2] != out.shape[-2]
    return transposed and (out.mesh, tuple(out.shape[-2:])) in param_shapes


_GRAD_OF = re.compile(r"^gradient of DistTensor '([^']*)'")


def grad_sync(plan: Plan, r: PlanReshard, param_names: set[str]) -> bool:
    """A reshard autograd inserted to bring a parameter's gradient to the parameter's layout."""
    if r.op is not None or r.phase != "backward":
        return False
    if plan.tensor(r.new_tensor).kind == "gradient":
        return True
    m = _GRAD_OF.match(r.reason)
    return m is not None and m.group(1) in param_names


def _op_stages(plan: Plan, op: PlanOp, mesh_stages: Mapping[int, list[int]]) -> list[int]:
    s = stage_of(plan, op)
    if s is not None:
        return [s]
    if not op.outputs:
        return []
    return list(mesh_stages.get(plan.tensor(op.outputs[0]).mesh, []))  # type: ignore[arg-type]


def _reshard_stages(plan: Plan, r: PlanReshard, mesh_stages: Mapping[int, list[int]]) -> list[int]:
    if r.op is not None and 0 <= r.op < len(plan.ops):
        s = stage_of(plan, plan.ops[r.op])
        if s is not None:
            return [s]
    return list(mesh_stages.get(r.src_mesh, []))


def stage_prices(plan: Plan, profile: HardwareProfile, costs: PlanCosts | None = None) -> StagePrices:
    """Per-stage seconds of ``plan`` on ``profile`` (module docstring); the plan needs ``pipeline.stages``."""
    stages = stage_meshes(plan)
    if not stages:
        raise ValueError("this plan has no pipeline section (pipeline.stages): nothing to price per stage")
    one_step = bool((plan.pipeline or {}).get(ONE_STEP))
    if one_step:
        # The whole step as one stage (``priced``): each mesh priced as a part of its own, the parts
        # then run one after the other (an eager step waits for each mesh's output in turn).
        stages = {i: m.id for i, m in enumerate(plan.meshes)}
    n = max(stages) + 1
    if sorted(stages) != list(range(n)):
        raise ValueError(f"plan field pipeline.stages: stages {sorted(stages)} are not 0..{n - 1}")
    costs = costs or PlanCosts(plan, profile)
    eager = profile.prices_eager_runtime
    mesh_stages = {m: [s] for s, m in stages.items()} if one_step else _mesh_stages(plan)
    lanes = 1 if one_step else _num_lanes(plan)
    mesh_lane = {mid: ss[0] % lanes for mid, ss in mesh_stages.items()}
    mesh_of_op = {}  # one_step: an op's part is its output's mesh, whatever its scope says
    if one_step:
        mesh_of_op = {op.index: plan.tensor(op.outputs[0]).mesh for op in plan.ops if op.outputs}
    param_shapes = {(t.mesh, tuple(t.shape)) for t in plan.tensors if t.kind == "parameter"}
    ledgers = {(phase, s): _Ledger() for phase in (*PHASES, "weight") for s in range(n)}
    param_names = {t.name for t in plan.tensors if t.kind == "parameter" and t.name}
    sync = {lane: _Ledger() for lane in range(lanes)}
    opt = {lane: _Ledger() for lane in range(lanes)}
    opt_comm = {lane: _Ledger() for lane in range(lanes)}
    sends = {(phase, s): _Ledger() for phase in PHASES for s in range(max(n - 1, 0))}

    for op in plan.ops:
        if op.phase == "optimizer":
            lane = mesh_lane.get(plan.tensor(op.outputs[0]).mesh) if op.outputs else None  # type: ignore[arg-type]
            if lane is not None:
                opt[lane].add(costs.op_ranks(op), costs.op_times(op))
            continue
        if op.phase not in PHASES:
            continue
        owners = (
            list(mesh_stages.get(mesh_of_op.get(op.index), []))
            if one_step  # type: ignore[arg-type]
            else _op_stages(plan, op, mesh_stages)
        )
        if not owners:
            continue
        times = costs.op_times(op)
        weight = _weight_op(plan, op, param_shapes)
        for s in owners:
            ledgers[(op.phase, s)].add(costs.op_ranks(op), times, 1.0 / len(owners))
            if weight:
                ledgers[("weight", s)].add(costs.op_ranks(op), times, 1.0 / len(owners))

    for r in plan.reshards:
        if r.phase == "optimizer":
            lane = mesh_lane.get(r.src_mesh)
            if lane is not None:
                opt_comm[lane].add(costs.reshard_ranks(r), costs.reshard_times(r))
            continue
        if r.phase not in PHASES:
            continue
        if grad_sync(plan, r, param_names) and r.src_mesh in mesh_lane:
            if eager:  # reduced in each micro-batch's backward, with its weight gradients
                owners = list(mesh_stages.get(r.src_mesh, [])) if one_step else _reshard_stages(plan, r, mesh_stages)
                for s in owners:
                    for bucket in ("backward", "weight"):
                        ledgers[(bucket, s)].add(costs.reshard_ranks(r), costs.reshard_times(r), 1.0 / len(owners))
            else:
                sync[mesh_lane[r.src_mesh]].add(costs.reshard_ranks(r), costs.reshard_times(r))
            continue
        if r.src_mesh != r.dst_mesh:
            src = mesh_stages.get(r.src_mesh, [])
            dst = mesh_stages.get(r.dst_mesh, [])
            # forward: stage s -> s + 1 is send_forward[s]; backward: s + 1 -> s is send_backward[s]
            pairs = [(a, b) for a in src for b in dst if abs(a - b) == 1]
            # interleaved meshes hold several stages: the hand-off is shared by the edges it may serve
            edges = sorted({min(a, b) for a, b in pairs if (b > a) == (r.phase == "forward")})
            if edges:
                for e in edges:
                    sends[(r.phase, e)].add(costs.reshard_ranks(r), costs.reshard_times(r), 1.0 / len(edges))
                continue
        owners = list(mesh_stages.get(r.src_mesh, [])) if one_step else _reshard_stages(plan, r, mesh_stages)
        for s in owners:
            ledgers[(r.phase, s)].add(costs.reshard_ranks(r), costs.reshard_times(r), 1.0 / len(owners))

    forward = tuple(ledgers[("forward", s)].most() for s in range(n))
    backward = tuple(ledgers[("backward", s)].most() for s in range(n))
    weight = tuple(min(ledgers[("weight", s)].most(), backward[s]) for s in range(n))
    send_f = tuple(sends[("forward", s)].most() for s in range(n - 1))
    send_b = tuple(sends[("backward", s)].most() for s in range(n - 1))
    if one_step:  # the parts one after the other, hand-offs between them included
        forward, backward, weight = (sum(forward) + sum(send_f),), (sum(backward) + sum(send_b),), (sum(weight),)
        send_f = send_b = ()
    return StagePrices(
        forward,
        backward,
        weight,
        send_f,
        send_b,
        {lane: sync[lane].most() for lane in range(lanes)},
        {lane: opt[lane].most() for lane in range(lanes)},
        {lane: opt_comm[lane].most() for lane in range(lanes)},
        profile.name or "profile",
        eager,
    )


def cost_section(prices: StagePrices) -> dict[str, Any]:
    """The ``pipeline.cost`` section ``viz.simulate.plan_cost`` reads, in seconds."""
    return {
        "time_unit": "s",
        "profile": prices.profile,
        "source": "viz.plan_time (simulator.op_cost.PlanCosts)",
        "forward": list(prices.forward),
        "backward_input": [b - w for b, w in zip(prices.backward, prices.backward_weight, strict=True)],
        "backward_weight": list(prices.backward_weight),
        "send_forward": list(prices.send_forward),
        "send_backward": list(prices.send_backward),
        "blocking_transfers": prices.eager_runtime,
    }


def step_end_section(prices: StagePrices) -> dict[str, list[dict[str, Any]]]:
    """``pipeline.step_end``: gradient sync, optimizer and its reshards, once per step on each lane."""
    out: dict[str, list[dict[str, Any]]] = {}
    for lane in sorted(prices.optimizer):
        items = []
        if prices.grad_sync.get(lane, 0.0) > 0:
            items.append({"name": "gradient sync", "kind": "COLL", "track": "comm", "duration": prices.grad_sync[lane]})
        if prices.optimizer[lane] > 0:
            items.append({"name": "optimizer", "kind": "OPT", "track": "compute", "duration": prices.optimizer[lane]})
        if prices.optimizer_comm.get(lane, 0.0) > 0:
            items.append(
                {"name": "optimizer reshards", "kind": "COLL", "track": "comm", "duration": prices.optimizer_comm[lane]}
            )
        if items:
            out[str(lane)] = items
    return out


def naive_stages(plan: Plan) -> list[int]:
    """The stage meshes of a pipeline run by reshards alone (no schedule: ``gpt.py --mesh
    dp=2,tp=2,pp=2``): the meshes holding forward ops, in the order the forward first uses
    them, when there are several and no two share a rank; else empty (one stage)."""
    order: list[int] = []
    for op in plan.ops:
        if op.phase == "forward" and op.outputs:
            mid = plan.tensor(op.outputs[0]).mesh
            if mid is not None and mid not in order:
                order.append(mid)
    if len(order) < 2:
        return []
    seen: set[int] = set()
    for mid in order:
        ranks = set(plan.mesh(mid).process_ids)
        if ranks & seen:
            return []
        seen |= ranks
    return order


def one_step_pipeline(plan: Plan) -> dict[str, Any]:
    """A pipeline section for a plan without one, one micro-batch.

    A pipeline run by reshards alone (``naive_stages``) gets one stage per stage mesh, each on its
    own lane with its ranks, the hand-offs priced as sends. Otherwise the whole step is one stage:
    its lane is labelled with the ranks of the plan's largest mesh; every mesh's ops are priced in
    it (``stage_prices`` reads ``one_step``): per mesh its busiest rank, the meshes one after the
    other; forward, backward, then gradient sync and optimizer.
    """
    staged = naive_stages(plan)
    if staged:
        return {
            "stages": [{"stage": s, "mesh": mid} for s, mid in enumerate(staged)],
            "num_microbatches": 1,
            "schedule": build_schedule("1F1B", len(staged), 1).to_dict(),
        }
    mesh = max(plan.meshes, key=lambda m: (len(m.process_ids), -m.id))
    return {
        "stages": [{"stage": 0, "mesh": mesh.id, "rank": 0}],
        "num_microbatches": 1,
        "schedule": build_schedule("1F1B", 1, 1).to_dict(),
        ONE_STEP: True,
    }


def priced(plan: Plan, profile: HardwareProfile) -> Plan:
    """A copy of ``plan`` whose pipeline costs are its own ops and reshards on ``profile``, in seconds.

    The plan's own ``cost`` and ``step_end`` (if any) are replaced: every number then comes from
    one cost model on one profile. A plan without a pipeline section (an eager script's) gets
    ``one_step_pipeline``: its step as one stage. A plan without any mesh is returned as is.
    """
    if not plan.meshes:
        return plan
    pipeline = dict(plan.pipeline) if plan.pipeline and stage_meshes(plan) else one_step_pipeline(plan)
    plan = dataclasses.replace(plan, pipeline=pipeline)
    prices = stage_prices(plan, profile)
    pipeline = {**pipeline, "cost": cost_section(prices), "step_end": step_end_section(prices)}
    return dataclasses.replace(plan, pipeline=pipeline)


# ------------------------------------------------------------------------------ profiles from elsewhere
def profile_from_bytes(data: bytes, name: str) -> HardwareProfile:
    """A hardware profile from an uploaded file's bytes: size cap, JSON with bounded numbers and
    depth, then ``HardwareProfile.from_dict``'s field checks; every refusal names the field."""
    if not data.strip():
        raise ProfileError(f"profile {name}: the file is empty; expected a hardware profile (mpipar.hardware JSON)")
    if len(data) > MAX_PROFILE_BYTES:
        raise ProfileError(
            f"profile {name}: {len(data)} bytes is over the limit of {MAX_PROFILE_BYTES} bytes for a hardware profile"
        )
    if data[:1] == b"\x80":
        raise ProfileError(
            f"profile {name}: this looks like a Python pickle; profiles are JSON and are never unpickled"
        )
    try:
        doc = parse_json(data, kind="profile", max_bytes=MAX_PROFILE_BYTES, memory_factor=MEMORY_FACTOR)
    except FileFormatError as exc:
        raise ProfileError(f"profile {name}: {exc}") from None
    try:
        return HardwareProfile.from_dict(doc, source=f"profile {name}")
    except ValueError as exc:
        raise ProfileError(str(exc)) from None


def profile_from_path(path: str) -> HardwareProfile:
    """A calibrated profile file by path (regular files only, size-capped), validated as above."""
    name = os.path.expanduser(path.strip())
    if not name:
        raise ProfileError("profile path: empty; give the path of a calibrated profile JSON")
    try:
        data = read_bounded(name, kind="profile", max_bytes=MAX_PROFILE_BYTES)
    except FileFormatError as exc:
        raise ProfileError(f"profile {name}: {exc.problem}") from None
    return profile_from_bytes(data, name)


# ------------------------------------------------------------------------------ measured timelines
def measured_on_lanes(measured: Timeline, predicted: Timeline) -> Timeline:
    """A measured timeline with a lane per rank, redrawn on the predicted timeline's pipeline lanes.

    ``MPIPAR_TRACE`` writes one lane per rank; the prediction has one lane per stage mesh
    (``meta.lane_ranks``). Each pipeline lane shows the measured spans of the first rank of its
    stage mesh (ranks of one mesh run the same program). A measured timeline that already has the
    prediction's lanes (or a prediction without ``lane_ranks``) is returned as is.
    """
    lane_ranks = predicted.meta.get("lane_ranks")
    if not isinstance(lane_ranks, Mapping) or "lane_ranks" in measured.meta:
        return measured
    pick: dict[int, int] = {}
    for lane, ranks in lane_ranks.items():
        if isinstance(ranks, list) and ranks and str(lane).isdigit() and ranks[0] in measured.ranks:
            pick[int(ranks[0])] = int(lane)
    if not pick or set(pick) == set(pick.values()) == set(measured.ranks):
        return measured
    spans = [dataclasses.replace(s, rank=pick[s.rank], peer=None) for s in measured.spans if s.rank in pick]
    meta = {
        **measured.meta,
        "lane_ranks": {str(lane): [rank] for rank, lane in pick.items()},
        "measured_ranks": sorted(pick),
    }
    return Timeline(spans, ranks=sorted(pick.values()), time_unit=measured.time_unit, meta=meta)
