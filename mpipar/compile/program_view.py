"""A plan drawn as a program: Paddle's ``print(program)`` listing and its graph dump.

    print(listing(plan, title="main program", serial=False))   # ops, placements, communication
    write_graph(plan, ".", "main_program")                      # main_program.dot (+ .svg/.pdf)

Two views of one plan, as Paddle prints a serial program and its distributed one:

* ``serial=True``: the step as one device would run it -- every op in order (forward,
  backward, update) on global shapes, each tensor annotated with its mesh and placements,
  no communication;
* ``serial=False``: what one rank runs -- the same ops with that rank's local shapes and, in
  front of the op that needs it, each inserted communication step (kind, mesh axes, the
  placements it converts, bytes per rank).

Renderers are pure functions of the plan. Names come from user code and plan files, so the
DOT writer escapes every label; the ``dot`` tool (Graphviz), when installed, turns the ``.dot``
into ``.svg`` and ``.pdf`` under a time limit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable

from mpipar.compile.plan import Plan, PlanOp, PlanReshard, PlanTensor

PHASE_COLOURS = {"forward": "#dbeafe", "backward": "#fde68a", "optimizer": "#bbf7d0", "other": "#e5e7eb"}
DOT_TIMEOUT_S = 60
"""The longest ``dot`` may take to lay a graph out before the picture is given up (the .dot stays)."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _shape(t: PlanTensor, serial: bool, rank: int | None, dynamic: set[int]) -> list[int]:
    if t.id in dynamic:
        return [-1 if i == 0 else d for i, d in enumerate(t.shape)]
    if serial or not t.local_shapes or rank is None:
        return list(t.shape)
    return list(t.local_shapes[rank]) if rank < len(t.local_shapes) else list(t.shape)


def _rank_position(plan: Plan, mesh_id: int | None, rank: int) -> int | None:
    """The position of process ``rank`` in a mesh's process ids (local shapes are in that order)."""
    if mesh_id is None:
        return None
    ids = plan.meshes[mesh_id].process_ids
    return ids.index(rank) if rank in ids else None


def _tensor_line(plan: Plan, t: PlanTensor, serial: bool, rank: int, dynamic: set[int]) -> str:
    pos = _rank_position(plan, t.mesh, rank)
    where = "dense" if t.mesh is None else f"mesh {t.mesh} {t.placements}"
    here = "" if serial or t.mesh is None or pos is not None else "  (not on this rank)"
    shape = _shape(t, serial, pos, dynamic)
    return f"    {t.kind:<15} {t.name or f't{t.id}'} : {t.dtype} {shape}  {where}{here}"


def display_names(plan: Plan) -> dict[int, str]:
    """A name for every tensor: its own, else Paddle-style by the op that made it
    (``matmul_0.tmp_0``), else ``t<id>``."""
    names = {t.id: t.name for t in plan.tensors if t.name}
    counts: dict[str, int] = {}
    for op in plan.ops:
        n = counts.get(op.op, 0)
        counts[op.op] = n + 1
        for j, o in enumerate(op.outputs):
            names.setdefault(o, f"{op.op}_{n}.tmp_{j}")
    for t in plan.tensors:
        names.setdefault(t.id, f"t{t.id}")
    return names


def _on_rank(plan: Plan, op: PlanOp, rank: int) -> bool:
    """Does ``rank`` run ``op``? (It does unless every tensor of it lives on meshes without it.)"""
    meshes = {t.mesh for t in plan.tensors if t.mesh is not None and (t.id in op.inputs or t.id in op.outputs)}
    return not meshes or any(rank in plan.meshes[m].process_ids for m in meshes if m < len(plan.meshes))


def _comm_kind(r: PlanReshard, kind: str) -> str:
    return f"send mesh {r.src_mesh} -> mesh {r.dst_mesh}" if kind == "transfer" else kind


def _comm_line(r: PlanReshard) -> Iterable[str]:
    for s in r.steps:
        axes = ",".join(s.axes) or "-"
        yield f"      comm {_comm_kind(r, s.kind):<14} over {axes:<6} {s.src} -> {s.dst}  {_size(s.bytes_per_rank)}/rank"


def _pipeline_lines(plan: Plan, serial: bool, rank: int) -> list[str]:
    pipe = plan.pipeline if isinstance(plan.pipeline, dict) else None
    sched = pipe.get("schedule") if pipe else None
    if not isinstance(sched, dict):
        return []
    stages = ", ".join(f"stage {s.get('stage')} on mesh {s.get('mesh')}" for s in pipe.get("stages", []))  # type: ignore[union-attr]
    lines = [f"  pipeline: {sched.get('kind')}, {sched.get('num_microbatches')} micro-batches; {stages}"]
    actions = sched.get("actions")
    if isinstance(actions, list):
        shown = range(len(actions)) if serial else [rank] if rank < len(actions) else []
        for r in shown:
            lines.append(f"    rank {r} runs: {' '.join(map(str, actions[r]))}")
    return lines


def listing(
    plan: Plan, title: str = "program", serial: bool = False, rank: int = 0, dynamic: set[int] | None = None
) -> str:
    """The plan as a program listing (module docstring); ``rank``: whose local view (not serial)."""
    dynamic = dynamic or set()
    comm = sum(len(r.steps) for r in plan.reshards)
    head = (
        "serial (one device, placements as annotations)"
        if serial
        else f"rank {rank}'s view: local shapes and communication"
    )
    lines = [f"{{ // {title}: {head}"]
    lines.append(
        f"  // {len(plan.ops)} ops, {len(plan.tensors)} tensors" + ("" if serial else f", {comm} communication steps")
    )
    if dynamic:
        lines.append("  // a -1 (None) dimension of static.data is traced with size 2 in the shapes below it")
    for m in plan.meshes:
        lines.append(
            f"  mesh {m.id}: shape {list(m.shape)} process_ids {list(m.process_ids)} dim_names {list(m.dim_names)}"
        )
    lines.extend(_pipeline_lines(plan, serial, rank))
    names = display_names(plan)
    lines.append("  vars:")
    for t in plan.tensors:
        if t.kind in ("parameter", "input", "optimizer_state"):
            lines.append(_tensor_line(plan, t, serial, rank, dynamic))
    by_op: dict[int | None, list[PlanReshard]] = {}
    for r in plan.reshards:
        by_op.setdefault(r.op, []).append(r)
    phase = None
    skipped = 0
    for op in plan.ops:
        if not serial and not _on_rank(plan, op, rank):
            skipped += 1
            continue
        if op.phase != phase:
            phase = op.phase
            lines.append(f"  ops ({phase}):")
        if not serial:
            for r in by_op.get(op.index, []):
                lines.append(f"    reshard {names[r.tensor]} for {op.op}: {r.src} -> {r.dst}")
                lines.extend(_comm_line(r))
        ins = ", ".join(
            f"{names.get(i, f't{i}')}{'' if p == 'dense' else ' ' + p}"
            for i, p in zip(op.inputs, op.required_placements if not serial else op.input_placements, strict=False)
        )
        outs = ", ".join(
            f"{names.get(o, f't{o}')}{'' if p == 'dense' else ' ' + p}"
            for o, p in zip(op.outputs, op.output_placements, strict=False)
        )
        scope = f"  [{op.scope}]" if op.scope else ""
        lines.append(f"    {{{outs}}} = {op.op}({ins}){scope}")
    if skipped:
        lines.append(f"  // {skipped} ops of other ranks' stages not listed (serial_main_program lists every op)")
    if not serial:
        loose = by_op.get(None, [])
        if loose:
            lines.append("  communication outside ops (explicit reshards, gradient layouts):")
            for r in loose:
                lines.append(f"    reshard {names.get(r.tensor, f't{r.tensor}')} ({r.phase}): {r.reason}")
                lines.extend(_comm_line(r))
    for u in plan.meta.get("updates", []) if isinstance(plan.meta.get("updates"), list) else []:
        lines.append(
            f"  ops (optimizer): {u.get('optimizer')} update of {', '.join(map(str, u.get('parameters', [])))}"
        )
    lines.append("}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- graphviz
def _q(text: object) -> str:
    """A DOT string literal: quotes, backslashes and control characters escaped."""
    s = str(text)
    s = s.replace("\\", "\\\\").replace('"', '\\"')
    s = "".join(ch if ch >= " " or ch == "\n" else " " for ch in s).replace("\n", "\\n")
    return f'"{s[:400]}"'


def to_dot(
    plan: Plan, title: str = "program", serial: bool = False, rank: int = 0, dynamic: set[int] | None = None
) -> str:
    """The plan as a Graphviz digraph: ops (boxes, coloured by phase), tensors (ellipses, with
    shape and placements) and, unless ``serial``, the inserted communication (red diamonds)."""
    dynamic = dynamic or set()
    out = [f"digraph {_q(title)} {{", "  rankdir=TB;", f"  label={_q(title)};", "  node [fontsize=10];"]
    names = display_names(plan)
    used: set[int] = set()
    for op in plan.ops:
        used.update(op.inputs)
        used.update(op.outputs)
    for t in plan.tensors:
        if t.id not in used:
            continue
        pos = _rank_position(plan, t.mesh, rank)
        where = "" if t.mesh is None else f"\nmesh {t.mesh} {t.placements}"
        style = "filled" if t.kind == "parameter" else "solid"
        label = f"{names[t.id]}\n{t.dtype} {_shape(t, serial, pos, dynamic)}{where}"
        out.append(f'  t{t.id} [shape=ellipse, style={style}, fillcolor="#f3f4f6", label={_q(label)}];')
    by_op: dict[int | None, list[PlanReshard]] = {}
    for r in plan.reshards:
        by_op.setdefault(r.op, []).append(r)
    for op in plan.ops:
        colour = PHASE_COLOURS.get(op.phase, PHASE_COLOURS["other"])
        label = f"{op.op}\n{op.phase}" + (f"\n[{op.scope}]" if op.scope else "")
        out.append(f'  op{op.index} [shape=box, style=filled, fillcolor="{colour}", label={_q(label)}];')
        resharded = {r.tensor: r for r in by_op.get(op.index, [])} if not serial else {}
        for i in op.inputs:
            found = resharded.get(i)
            if found is None:
                out.append(f"  t{i} -> op{op.index};")
                continue
            r = found
            kinds = ", ".join(f"{_comm_kind(r, s.kind)}({','.join(s.axes)})" for s in r.steps)
            label = f"{kinds}\n{r.src} -> {r.dst}\n{_size(r.bytes_per_rank)}/rank"
            out.append(f"  c{r.index} [shape=diamond, color=red, fontcolor=red, label={_q(label)}];")
            out.append(f"  t{i} -> c{r.index} [color=red];")
            out.append(f"  c{r.index} -> op{op.index} [color=red];")
        for o in op.outputs:
            out.append(f"  op{op.index} -> t{o};")
    if not serial:
        for r in by_op.get(None, []):
            kinds = ", ".join(f"{_comm_kind(r, s.kind)}({','.join(s.axes)})" for s in r.steps)
            label = f"{kinds}\n{r.src} -> {r.dst}\n{_size(r.bytes_per_rank)}/rank"
            out.append(f"  c{r.index} [shape=diamond, color=red, fontcolor=red, label={_q(label)}];")
            if r.tensor in used:
                out.append(f"  t{r.tensor} -> c{r.index} [color=red];")
            if r.new_tensor in used:
                out.append(f"  c{r.index} -> t{r.new_tensor} [color=red];")
    for k, u in enumerate(plan.meta.get("updates", []) if isinstance(plan.meta.get("updates"), list) else []):
        label = f"{u.get('optimizer')}\noptimizer"
        out.append(f'  upd{k} [shape=box, style=filled, fillcolor="{PHASE_COLOURS["optimizer"]}", label={_q(label)}];')
        updated = set(map(str, u.get("parameters", [])))
        for t in plan.tensors:
            if (
                t.id in used
                and t.kind in ("parameter", "gradient")
                and (t.name in updated or t.name.removesuffix("@GRAD") in updated)
            ):
                out.append(f"  t{t.id} -> upd{k} [style=dashed];")
    out.append("}")
    return "\n".join(out) + "\n"


def write_graph(dot_text: str, directory: str, name: str) -> list[str]:
    """Write ``name.dot`` in ``directory``, and ``name.svg`` / ``name.pdf`` when Graphviz's
    ``dot`` is installed; return the paths written."""
    if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"graph name must be a plain file name, got {name!r}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name + ".dot")
    with open(path, "w", encoding="utf-8") as f:
        f.write(dot_text)
    written = [path]
    tool = shutil.which("dot")
    if tool is None:
        return written
    for fmt in ("svg", "pdf"):
        target = os.path.join(directory, f"{name}.{fmt}")
        try:
            done = subprocess.run(
                [tool, f"-T{fmt}", path, "-o", target],
                capture_output=True,
                timeout=DOT_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and os.path.exists(target):
            written.append(target)
    return written
