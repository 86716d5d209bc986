"""Per-rank memory section for any plan (``mpipar plan``'s own, not only the sample's).

A plan written by ``mpipar plan`` has tensors (kind, dtype, placements, local shapes) and a
pipeline section but no ``memory`` section, so the Memory view had nothing to draw. This
module derives that section from the plan itself, the way the sample does:

* model state: every tensor of kind parameter / gradient / optimizer_state (a named one in its
  last layout, ``state_tensors``), its local bytes on each rank of its mesh (optimizer states ``meta.host_tensors`` names, an offloading
  optimizer's, under ``host_optimizer_state``: host memory, not the device) (a plan traced before backward records no gradient tensors, so
  that category is what the plan holds, never a guess);
* activations: what the autograd tape keeps for backward, per stage, on each rank of its mesh.
  A plan traced by this mpipar records it (``meta.kept_for_backward``: each storage once, by the
  op keeping it, from ``mpipar.debug.memory.tape_storages`` -- the tensors ``dist.memory_report``
  sums, so the view's activations are the report's). An older plan without that record keeps
  the earlier estimate: forward outputs of kind activation, all but the inner ops of a
  recompute region;
* messages: the largest piece of each forward pipeline hand-off (a reshard whose step is a
  ``transfer`` between stage meshes), by sending stage.

    plan = with_memory(plan)          # the same plan, with a memory section when it had none
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpipar.compile.plan import HOST_TENSORS_KEY, KEPT_KEY, Plan
from viz.planinfo import local_bytes, rank_positions, stage_of

RECOMPUTE_SCOPE = "recompute"
STATE_CATEGORIES = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_state"}


HOST_KEY = "host_optimizer_state"
"""Memory-section key of the optimizer-state bytes an ``offload_optimizer`` keeps in host memory
(not on the device, so not in the device curve or peak)."""


def host_tensors(plan: Plan) -> set[int]:
    """Ids of the optimizer states the plan's ``meta.host_tensors`` says live in host memory.

    ``mpipar plan`` writes it for an offloading optimizer. The plan may come from anywhere: only
    entries that are ids of optimizer-state tensors count; anything else names nothing on the host.
    """
    listed = plan.meta.get(HOST_TENSORS_KEY)
    if not isinstance(listed, list):
        return set()
    states = {t.id for t in plan.tensors if t.kind == "optimizer_state"}
    return {i for i in listed if isinstance(i, int) and not isinstance(i, bool) and i in states}


def state_tensors(plan: Plan) -> set[int]:
    """Ids of the model-state tensors (parameters, gradients, optimizer states) a step holds.

    A state re-laid out during the traced step -- ZeRO-3 splits its parameters at the first
    update -- is in the plan once per layout under one name: its last entry is the layout it
    keeps from then on (the one ``memory_report`` sees in any later step). Unnamed entries count
    each.
    """
    last: dict[tuple[str, str], int] = {}
    out: set[int] = set()
    for t in plan.tensors:
        if t.kind not in STATE_CATEGORIES:
            continue
        if t.name:
            last[(t.kind, t.name)] = t.id
        else:
            out.add(t.id)
    return out | set(last.values())


def kept_forward_ops(plan: Plan) -> set[int]:
    """Forward ops whose outputs stay for backward: all but those inside a recompute region,
    whose last op's outputs (the region's result) are kept."""
    kept: set[int] = set()
    forward = [op for op in plan.ops if op.phase == "forward"]
    for i, op in enumerate(forward):
        parts = op.scope.split(".")
        if RECOMPUTE_SCOPE not in parts:
            kept.add(op.index)
            continue
        region = ".".join(parts[: parts.index(RECOMPUTE_SCOPE) + 1])
        nxt = forward[i + 1].scope if i + 1 < len(forward) else ""
        if not (nxt == region or nxt.startswith(region + ".")):
            kept.add(op.index)
    return kept


def kept_stages(plan: Plan) -> list[tuple[int, int]]:
    """``(tensor id, stage)`` per storage the plan's ``meta.kept_for_backward`` records.

    The stage is the keeping op's; for a node no op made (a recompute region's, keeping the
    region's inputs), the first forward op reading the tensor, else the one writing it, else
    the stage placed on its mesh. Entries naming nothing (the plan may come from anywhere;
    ``Plan.from_dict`` refuses them) or no stage are left out.
    """
    tensor_ids = {t.id for t in plan.tensors}
    forward = [op for op in plan.ops if op.phase == "forward"]
    by_index = {op.index: op for op in plan.ops}
    out: list[tuple[int, int]] = []
    for pair in plan.meta.get(KEPT_KEY) or []:
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] in tensor_ids):
            continue
        tid, index = pair
        op = by_index.get(index) if isinstance(index, int) and not isinstance(index, bool) else None
        if op is None:
            op = next((o for o in forward if tid in o.inputs), None) or next(
                (o for o in forward if tid in o.outputs), None
            )
        stage = stage_of(plan, op) if op is not None else _sending_stage(plan, plan.tensor(tid).mesh)
        if stage is not None:
            out.append((tid, stage))
    return out


def _add_kept(plan: Plan, ranks: dict[int, dict[str, Any]], positions: dict[int, dict[int, int]]) -> None:
    """Activations from the plan's record of what the tape keeps (a dense tensor: every rank)."""
    for tid, stage in kept_stages(plan):
        t = plan.tensor(tid)
        holders = positions[t.mesh].items() if t.mesh is not None else ((r, 0) for r in ranks)
        for r, i in holders:
            acts = ranks[r]["activations"]
            acts[str(stage)] = acts.get(str(stage), 0) + local_bytes(t, i)


def _sending_stage(plan: Plan, mesh_id: int | None) -> int | None:
    """The first pipeline stage placed on ``mesh_id`` (the stage that sends a hand-off from it)."""
    for s in (plan.pipeline or {}).get("stages", []) or []:
        if isinstance(s, dict) and s.get("mesh") == mesh_id and isinstance(s.get("stage"), int):
            return int(s["stage"])
    return None


def memory_section(plan: Plan, capacity_bytes: float | None = None, profile: str | None = None) -> dict[str, Any]:
    """``{"capacity_bytes", "profile", "ranks": [{rank, parameters, gradients, optimizer_state,
    activations: {stage: bytes}, messages: {stage: bytes}}]}`` derived from the plan's tensors."""
    positions = rank_positions(plan)
    ranks: dict[int, dict[str, Any]] = {}
    for m in plan.meshes:
        for r in m.process_ids:
            ranks[r] = {
                "rank": r,
                "parameters": 0,
                "gradients": 0,
                "optimizer_state": 0,
                "activations": {},
                "messages": {},
            }
    on_host = host_tensors(plan)
    current = state_tensors(plan)
    for t in plan.tensors:
        if t.mesh is None or t.id not in current:
            continue
        for r, i in positions[t.mesh].items():
            if t.id in on_host:
                ranks[r][HOST_KEY] = ranks[r].get(HOST_KEY, 0) + local_bytes(t, i)
            else:
                ranks[r][STATE_CATEGORIES[t.kind]] += local_bytes(t, i)
    if isinstance(plan.meta.get(KEPT_KEY), list):
        _add_kept(plan, ranks, positions)
        kept: set[int] = set()
    else:
        kept = kept_forward_ops(plan)
    for op in plan.ops:
        s = stage_of(plan, op)
        if op.phase != "forward" or s is None or op.index not in kept:
            continue
        for tid in op.outputs:
            t = plan.tensor(tid)
            if t.mesh is None or t.kind != "activation":
                continue
            for r, i in positions[t.mesh].items():
                acts = ranks[r]["activations"]
                acts[str(s)] = acts.get(str(s), 0) + local_bytes(t, i)
    for reshard in plan.reshards:
        if reshard.phase != "forward" or reshard.src_mesh == reshard.dst_mesh:
            continue
        transfers = [step for step in reshard.steps if step.kind == "transfer"]
        stage = _sending_stage(plan, reshard.src_mesh)
        if not transfers or stage is None:
            continue
        size = max((p[2] for step in transfers for p in step.pieces), default=0)
        for rank in ranks.values():
            rank["messages"][str(stage)] = rank["messages"].get(str(stage), 0) + size
    return {"capacity_bytes": capacity_bytes, "profile": profile, "ranks": [ranks[r] for r in sorted(ranks)]}


def with_memory(plan: Plan) -> Plan:
    """The plan itself when it has a memory section or no pipeline; else a copy with one derived."""
    if plan.memory is not None or not plan.pipeline:
        return plan
    return dataclasses.replace(plan, memory=memory_section(plan))
