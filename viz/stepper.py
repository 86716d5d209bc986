"""Reshard stepper: one reshard of a plan, step by step, with each rank's content before and after.

    steps = reshard_steps(plan, plan.reshards[3])
    stepper_figure(plan, plan.reshards[3], 0)      # step 0: before | after, groups outlined
    print(stepper_text(plan, plan.reshards[3], 0))

The steps are the plan's recorded ones (kind, mesh axes, placements before and after, bytes);
the boxes each rank holds come from the chunking rule applied to those placements, on the
source mesh up to a cross-mesh transfer and on the destination mesh after it. A collective's
groups are ``mesh.groups(axes)``: the ranks that talk to each other in that step. A transfer's
pieces are the boxes each destination rank receives from each source rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure

from mpipar.compile.plan import Plan, PlanReshard, PlanStep
from mpipar.spec import Box, DistSpec, box_intersect
from viz.figures import block_color, new_figure
from viz.layout import box_text, draw_mesh_grid, layout_blocks
from viz.planinfo import fmt_bytes, fmt_ranks, spec_of
from viz.propagation import step_text

GROUP_EDGES = ("#000000", "#D62728", "#1F77B4", "#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#17BECF")


@dataclass(frozen=True)
class StepView:
    index: int
    step: PlanStep
    before: DistSpec
    after: DistSpec
    groups: tuple[tuple[int, ...], ...]
    """Ranks that communicate in this step (collective groups; for transfers, (src, dst) pairs)."""
    pieces: tuple[tuple[int, int, Box], ...]
    """For transfers: (source rank, destination rank, global box received)."""

    @property
    def description(self) -> str:
        return step_text(self.step)


def reshard_steps(plan: Plan, r: PlanReshard) -> list[StepView]:
    """The recorded steps of ``r`` with the specs before and after each."""
    views = []
    mesh = r.src_mesh
    for i, step in enumerate(r.steps):
        before = spec_of(plan, r.shape, mesh, step.src)
        if step.kind == "transfer":
            mesh = r.dst_mesh
        after = spec_of(plan, r.shape, mesh, step.dst)
        groups: tuple[tuple[int, ...], ...] = ()
        pieces: tuple[tuple[int, int, Box], ...] = ()
        if step.kind == "transfer":
            pairs = sorted({(s, d) for s, d, _ in step.pieces})
            groups = tuple(pairs)
            found = []
            for s, d in pairs:
                if s in before.boxes and d in after.boxes:
                    box = box_intersect(before.boxes[s], after.boxes[d])
                    if box is not None:
                        found.append((s, d, box))
            pieces = tuple(found)
        elif step.axes:
            m = before.mesh
            groups = tuple(m.groups([m.dim_names.index(a) for a in step.axes]))
        views.append(StepView(i, step, before, after, groups, pieces))
    return views


def _group_of(view: StepView) -> dict[int, int]:
    out: dict[int, int] = {}
    if view.step.kind == "transfer":
        return out
    for g, members in enumerate(view.groups):
        for r in members:
            out[r] = g
    return out


def stepper_figure(plan: Plan, r: PlanReshard, step: int) -> Figure:
    """Before | after panels of step ``step``: cells coloured by block, outlined by group."""
    views = reshard_steps(plan, r)
    if not 0 <= step < len(views):
        raise ValueError(f"reshard #{r.index} has {len(views)} step(s); step {step} does not exist")
    view = views[step]
    group = _group_of(view)
    fig = new_figure(11.0, 1.8 + 0.9 * min(max(view.before.mesh.shape[0] if view.before.mesh.ndim > 1 else 1, 1), 8))
    for col, (spec, title) in enumerate(((view.before, "before"), (view.after, "after"))):
        ax = fig.add_subplot(1, 2, col + 1)
        index = {rank: b.index for b in layout_blocks(spec) for rank in b.ranks}
        colors = {rank: block_color(i) for rank, i in index.items()}
        senders: dict[int, list[int]] = {}
        if col == 1:
            for s, d, _ in view.pieces:
                if s != d:
                    senders.setdefault(d, []).append(s)
        texts = {}
        for rank in spec.mesh.process_ids:
            g = f"  g{group[rank]}" if rank in group else ""
            frm = f"\nfrom {fmt_ranks(sorted(senders[rank]), 3)}" if rank in senders else ""
            texts[rank] = f"rank {rank}{g}\n{box_text(spec, spec.boxes[rank])}{frm}"
        edges = {rank: GROUP_EDGES[g % len(GROUP_EDGES)] for rank, g in group.items()} if group else None
        draw_mesh_grid(ax, spec.mesh, colors, texts, edges)
        ax.set_title(f"{title}: {spec.placements_str} on mesh {fmt_ranks(spec.mesh.process_ids)}", fontsize=9)
    fig.suptitle(f"reshard #{r.index} step {step + 1}/{len(views)}: {view.description}", fontsize=10)
    return fig


def stepper_text(plan: Plan, r: PlanReshard, step: int, max_ranks: int = 64) -> str:
    views = reshard_steps(plan, r)
    if not 0 <= step < len(views):
        raise ValueError(f"reshard #{r.index} has {len(views)} step(s); step {step} does not exist")
    view = views[step]
    lines = [
        f"reshard #{r.index} {list(r.shape)} {r.src} -> {r.dst}: step {step + 1}/{len(views)}",
        f"  {view.description}",
    ]
    if view.step.kind == "transfer":
        lines.append(f"  {len(view.pieces)} piece(s), {fmt_bytes(sum(p[2] for p in view.step.pieces))} in all:")
        for s, d, box in view.pieces[:max_ranks]:
            lines.append(f"    rank {s} -> rank {d}: {box_text(view.before, box)}")
        if len(view.pieces) > max_ranks:
            lines.append(f"    ... {len(view.pieces) - max_ranks} more")
        before_ranks = view.before.mesh.process_ids
        after_ranks = view.after.mesh.process_ids
        lines.append("  before (source mesh):")
        lines += [f"    rank {x}: {box_text(view.before, view.before.boxes[x])}" for x in before_ranks[:max_ranks]]
        lines.append("  after (destination mesh):")
        lines += [f"    rank {x}: {box_text(view.after, view.after.boxes[x])}" for x in after_ranks[:max_ranks]]
        return "\n".join(lines) + "\n"
    group = _group_of(view)
    if view.groups:
        lines.append(
            f"  {len(view.groups)} group(s) of {len(view.groups[0])}: "
            + "; ".join(fmt_ranks(g) for g in view.groups[:8])
            + (" ..." if len(view.groups) > 8 else "")
        )
    for rank in view.before.mesh.process_ids[:max_ranks]:
        g = f" (group {group[rank]})" if rank in group else ""
        lines.append(
            f"    rank {rank}{g}: {box_text(view.before, view.before.boxes[rank])} -> {box_text(view.after, view.after.boxes[rank])}"
        )
    if view.before.mesh.size > max_ranks:
        lines.append(f"    ... {view.before.mesh.size - max_ranks} more ranks")
    return "\n".join(lines) + "\n"
