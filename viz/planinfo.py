"""Plan queries the dashboard's views share: meshes and specs from a plan, bytes, stages, groups.

A plan stores meshes as ids and placements as compact strings (``S(0)R``); the views need
``ProcessMesh``/``DistSpec`` values to ask for boxes, groups and reshard steps. Meshes are
rebuilt with ``mpipar.compile.plan.process_mesh`` (not checked against a backend's world) so a plan of
a 1024-rank world opens in a process that hosts none of it; dtype sizes come from
``mpipar.compile.plan.itemsize``, the plan's own table. All functions are pure and cheap to call again
(specs are cached).

    mesh = plan_mesh(plan, 0); spec = tensor_spec(plan, plan.tensors[3])
    stage_of(plan, op)        # the pipeline stage an op belongs to, from its scope or its mesh
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from mpipar.compile.plan import Plan, PlanMesh, PlanOp, PlanTensor, itemsize, process_mesh
from mpipar.mesh import ProcessMesh
from mpipar.placement import parse_placements
from mpipar.spec import DistSpec

_STAGE_SCOPE = re.compile(r"^stage(\d+)(?:\.|$)")


def plan_mesh(plan: Plan, mesh_id: int) -> ProcessMesh:
    return process_mesh(plan.mesh(mesh_id))


@functools.lru_cache(maxsize=4096)
def _spec(shape: tuple[int, ...], m: PlanMesh, placements: str) -> DistSpec:
    return DistSpec(shape, process_mesh(m), parse_placements(placements))


def spec_of(plan: Plan, shape: Sequence[int], mesh_id: int, placements: str) -> DistSpec:
    return _spec(tuple(shape), plan.mesh(mesh_id), placements)


def tensor_spec(plan: Plan, tensor: PlanTensor) -> DistSpec | None:
    """The tensor's layout, or None for a dense (undistributed) tensor."""
    if tensor.mesh is None:
        return None
    return spec_of(plan, tensor.shape, tensor.mesh, tensor.placements)


def tensor_label(t: PlanTensor) -> str:
    """``#12 fc1.weight (parameter) [16, 64] RS(1)``."""
    name = f" {t.name}" if t.name else ""
    pls = f" {t.placements}" if t.placements else " dense"
    return f"#{t.id}{name} ({t.kind}) {list(t.shape)}{pls}"


def local_numel(t: PlanTensor, index: int) -> int:
    """Elements held by the rank at mesh position ``index`` (its place in ``process_ids``)."""
    shape = t.local_shapes[index] if t.local_shapes else t.shape
    out = 1
    for n in shape:
        out *= n
    return out


def local_bytes(t: PlanTensor, index: int) -> int:
    return local_numel(t, index) * itemsize(t.dtype)


def rank_positions(plan: Plan) -> dict[int, dict[int, int]]:
    """``{mesh id: {rank: position in the mesh's process_ids}}``."""
    return {m.id: {r: i for i, r in enumerate(m.process_ids)} for m in plan.meshes}


def all_ranks(plan: Plan) -> list[int]:
    return sorted({r for m in plan.meshes for r in m.process_ids})


def stage_meshes(plan: Plan) -> dict[int, int]:
    """``{stage: mesh id}`` from the plan's pipeline section (empty without one)."""
    stages = (plan.pipeline or {}).get("stages") or []
    out: dict[int, int] = {}
    for s in stages:
        if isinstance(s, dict) and isinstance(s.get("stage"), int) and isinstance(s.get("mesh"), int):
            out[s["stage"]] = s["mesh"]
    return out


def stage_of(plan: Plan, op: PlanOp) -> int | None:
    """The stage an op runs in: ``stageN`` at the head of its scope, else the stage owning its output's mesh.

    The mesh alone is ambiguous when a rank holds several stages (interleaved schedules); the
    scope settles it.
    """
    m = _STAGE_SCOPE.match(op.scope)
    if m:
        return int(m.group(1))
    meshes = stage_meshes(plan)
    if not meshes or not op.outputs:
        return None
    try:
        mesh = plan.tensor(op.outputs[0]).mesh
    except KeyError:
        return None
    owners = [s for s, mid in meshes.items() if mid == mesh]
    return owners[0] if len(owners) == 1 else None


def layer_of(op: PlanOp) -> str:
    """The layer filter key of an op: its scope, or ``(no scope)``."""
    return op.scope or "(no scope)"


def axis_indices(mesh: ProcessMesh, names: Sequence[str]) -> tuple[int, ...]:
    return tuple(mesh.dim_names.index(a) for a in names)


def group_size(mesh: ProcessMesh, names: Sequence[str]) -> int:
    n = 1
    for a in axis_indices(mesh, names):
        n *= mesh.shape[a]
    return n


def fmt_bytes(n: float) -> str:
    """``0 B``, ``512 B``, ``1.50 KiB``, ``3.00 GiB``."""
    n = float(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ranks(ranks: Sequence[int], limit: int = 6) -> str:
    """``0,1,2`` or ``0-15`` for a run, ``0,4,8,...(+13)`` past ``limit``."""
    rs = list(ranks)
    if not rs:
        return "-"
    if len(rs) > 2 and rs == list(range(rs[0], rs[0] + len(rs))):
        return f"{rs[0]}-{rs[-1]}"
    if len(rs) <= limit:
        return ",".join(str(r) for r in rs)
    return ",".join(str(r) for r in rs[:limit]) + f",...(+{len(rs) - limit})"
