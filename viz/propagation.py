"""Propagation trace view: every op in order with its placements and rule, inserted reshards highlighted.

    rows = trace_rows(plan, layer="stage0", collective="all_reduce")
    print(trace_text(plan, phase="backward"))

A row is an op (input placements, the rule and its decision, the placements the rule required,
output placements) or a reshard (``S(0)P(sum) -> S(0)R: all_reduce(sum) on tp``) with its
steps and bytes. Reshards an op asked for come right before it; reshards no op asked for
(gradients brought to their parameter's layout, pipeline hand-offs) are placed where they
happened: tensor ids grow as tracing goes, so the reshard comes before the first op whose
outputs are newer than its result.

Filters (all optional, combined with "and"): ``layer`` (a scope prefix: ``stage0.block0``
matches ``stage0.block0.fc1``), ``tensor`` (a tensor id: ops reading or writing it, reshards
of it), ``collective`` (a step kind such as ``all_reduce``: reshards with such a step and the
ops that asked for them), ``phase``.
"""

from __future__ import annotations

import bisect
from typing import Any

from mpipar.compile.plan import Plan, PlanReshard, PlanStep
from viz.planinfo import fmt_bytes, layer_of

COMM_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "transfer")


def step_text(step: PlanStep) -> str:
    """``all_reduce(sum) on tp: S(0)P(sum) -> S(0)R [256 B/rank]``."""
    rt = f"({step.reduce_type})" if step.reduce_type else ""
    where = f" on {','.join(step.axes)}" if step.axes else ""
    if step.kind == "transfer":
        where = f" ({len(step.pieces)} messages)"
    cost = f" [{fmt_bytes(step.bytes_per_rank)}/rank]" if step.kind in COMM_KINDS else ""
    return f"{step.kind}{rt}{where}: {step.src} -> {step.dst}{cost}"


def reshard_text(plan: Plan, r: PlanReshard) -> str:
    """``#3 [8, 16] S(0)P(sum) -> S(0)R (mesh 0): all_reduce(sum) on tp``."""
    where = f"mesh {r.src_mesh}" if r.src_mesh == r.dst_mesh else f"mesh {r.src_mesh} -> mesh {r.dst_mesh}"
    kinds = ", ".join(f"{s.kind}" + (f" on {','.join(s.axes)}" if s.axes else "") for s in r.steps) or "no step"
    return f"#{r.index} {list(r.shape)} {r.src} -> {r.dst} ({where}): {kinds}"


def _reshard_positions(plan: Plan) -> dict[int, int]:
    """For reshards no op asked for: the op index they come before (len(ops) when after all)."""
    firsts = [min(o.outputs) if o.outputs else -1 for o in plan.ops]
    # Ops' newest output ids only grow; a running max keeps bisect valid if one op outputs nothing.
    running, keys = -1, []
    for f in firsts:
        running = max(running, f)
        keys.append(running)
    return {r.index: bisect.bisect_right(keys, r.new_tensor) for r in plan.reshards if r.op is None}


def _tensor_ref(plan: Plan, tid: int, placements: str) -> str:
    try:
        t = plan.tensor(tid)
    except KeyError:
        return f"#{tid}: {placements}"
    return f"#{tid}{' ' + t.name if t.name else ''}: {placements}"


def _reshard_row(plan: Plan, r: PlanReshard) -> dict[str, Any]:
    return {
        "row": "reshard",
        "index": r.index,
        "phase": r.phase,
        "layer": "",
        "op": "reshard",
        "inputs": _tensor_ref(plan, r.tensor, r.src),
        "rule": r.reason,
        "decision": "; ".join(step_text(s) for s in r.steps) or "no step",
        "required": r.dst,
        "outputs": _tensor_ref(plan, r.new_tensor, r.dst),
        "reshards": f"{r.src} -> {r.dst}",
        "collectives": ", ".join(s.kind for s in r.steps if s.kind in COMM_KINDS),
        "bytes/rank": r.bytes_per_rank,
    }


def _matches_reshard(r: PlanReshard, tensor: int | None, collective: str | None) -> bool:
    if tensor is not None and tensor not in (r.tensor, r.new_tensor):
        return False
    return collective is None or any(s.kind == collective for s in r.steps)


def trace_rows(
    plan: Plan,
    layer: str | None = None,
    tensor: int | None = None,
    collective: str | None = None,
    phase: str | None = None,
) -> list[dict[str, Any]]:
    """The trace as table rows (see the module docstring for order and filters)."""
    before: dict[int, list[PlanReshard]] = {}
    for r in plan.reshards:
        if r.op is not None and 0 <= r.op < len(plan.ops):
            before.setdefault(r.op, []).append(r)
    loose: dict[int, list[PlanReshard]] = {}
    for index, pos in _reshard_positions(plan).items():
        loose.setdefault(pos, []).append(plan.reshards[index])
    rows: list[dict[str, Any]] = []

    def emit_loose(pos: int) -> None:
        for r in loose.get(pos, []):
            if layer or (phase and r.phase != phase) or not _matches_reshard(r, tensor, collective):
                continue
            rows.append(_reshard_row(plan, r))

    for op in plan.ops:
        emit_loose(op.index)
        if phase and op.phase != phase:
            continue
        if layer and not layer_of(op).startswith(layer):
            continue
        asked = before.get(op.index, [])
        if (
            tensor is not None
            and tensor not in op.inputs
            and tensor not in op.outputs
            and not any(_matches_reshard(r, tensor, None) for r in asked)
        ):
            continue
        if collective is not None and not any(_matches_reshard(r, None, collective) for r in asked):
            continue
        for r in asked:
            rows.append(_reshard_row(plan, r))
        rows.append(
            {
                "row": "op",
                "index": op.index,
                "phase": op.phase,
                "layer": layer_of(op),
                "op": op.op,
                "inputs": ", ".join(
                    _tensor_ref(plan, t, p) for t, p in zip(op.inputs, op.input_placements, strict=False)
                ),
                "rule": op.rule,
                "decision": op.decision,
                "required": ", ".join(op.required_placements),
                "outputs": ", ".join(
                    _tensor_ref(plan, t, p) for t, p in zip(op.outputs, op.output_placements, strict=False)
                ),
                "reshards": ", ".join(f"#{r.index}" for r in asked),
                "collectives": ", ".join(s.kind for r in asked for s in r.steps if s.kind in COMM_KINDS),
                "bytes/rank": sum(r.bytes_per_rank for r in asked),
            }
        )
    emit_loose(len(plan.ops))
    return rows


def filter_choices(plan: Plan) -> dict[str, list[Any]]:
    """Values the filters can take: layers (every scope prefix), tensors, collectives, phases."""
    layers: set[str] = set()
    for op in plan.ops:
        parts = layer_of(op).split(".")
        layers.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    kinds = sorted({s.kind for r in plan.reshards for s in r.steps})
    return {
        "layer": sorted(layers),
        "tensor": [t.id for t in plan.tensors],
        "collective": kinds,
        "phase": sorted({o.phase for o in plan.ops} | {r.phase for r in plan.reshards}),
    }


def trace_text(
    plan: Plan,
    layer: str | None = None,
    tensor: int | None = None,
    collective: str | None = None,
    phase: str | None = None,
    limit: int = 400,
) -> str:
    """The trace as text; reshard rows start with ``>>``."""
    rows = trace_rows(plan, layer, tensor, collective, phase)
    lines = [f"propagation trace: {len(rows)} row(s)" + (f", first {limit}" if len(rows) > limit else "")]
    for row in rows[:limit]:
        if row["row"] == "reshard":
            lines.append(
                f"  >> reshard #{row['index']} [{row['phase']}] {row['inputs']} -> {row['required']}"
                + (f"  ({row['rule']})" if row["rule"] else "")
            )
            for part in str(row["decision"]).split("; "):
                lines.append(f"       {part}")
        else:
            lines.append(f"  {row['index']:>4} [{row['phase']}] {row['layer']}: {row['op']}({row['inputs']})")
            lines.append(f"       rule {row['rule'] or '-'}: {row['decision'] or '-'}")
            lines.append(f"       needs {row['required'] or '-'} -> {row['outputs']}")
    return "\n".join(lines) + "\n"
