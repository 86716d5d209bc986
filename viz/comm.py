"""Communication view: counts and bytes by collective and mesh axis, forward/backward split, rank x rank traffic.

    comm_table(plan)             # rows (phase, collective, axes, count, bytes per rank)
    comm_figure(plan)            # counts by collective and bytes by mesh axis, stacked by phase
    traffic_matrix(plan)         # (ranks, matrix[i, j] = bytes rank i receives from rank j)
    traffic_figure(plan)         # the matrix as a heatmap
    print(comm_text(plan))

Bytes are the plan's: received by the busiest rank of each step (ring formulas for
reductions). The traffic matrix charges every member of a collective's group the step's bytes
per rank, spread evenly over the other members of its group (the exchange a direct algorithm
does; a ring sends the same total over neighbours); transfers by their pieces, exactly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from mpipar.compile.plan import PHASES, Plan
from viz.figures import COLLECTIVE_COLORS, empty_notice, new_figure
from viz.planinfo import all_ranks, fmt_bytes, plan_mesh
from viz.propagation import COMM_KINDS

PHASE_HATCH = {"forward": "", "backward": "//", "optimizer": "..", "other": "xx"}
PHASE_COLORS = {"forward": "#4C78A8", "backward": "#E15759", "optimizer": "#59A14F", "other": "#BAB0AC"}


def comm_table(plan: Plan, phase: str | None = None) -> list[dict[str, Any]]:
    """One row per (phase, collective, mesh axes): calls and bytes received per rank, summed."""
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in plan.reshards:
        if phase is not None and r.phase != phase:
            continue
        for s in r.steps:
            if s.kind not in COMM_KINDS:
                continue
            axes = ",".join(s.axes) if s.axes else ("p2p" if s.kind == "transfer" else "-")
            entry = acc[(r.phase, s.kind, axes)]
            entry[0] += 1
            entry[1] += s.bytes_per_rank
    order = {p: i for i, p in enumerate(PHASES)}
    rows = [
        {"phase": ph, "collective": kind, "axes": axes, "count": int(v[0]), "bytes/rank": v[1]}
        for (ph, kind, axes), v in acc.items()
    ]
    return sorted(rows, key=lambda row: (order.get(row["phase"], 9), row["collective"], row["axes"]))


def _by(rows: list[dict[str, Any]], key: str, value: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows:
        out[row[key]][row["phase"]] += row[value]
    return out


def comm_figure(plan: Plan) -> Figure:
    """Two panels: calls per collective and bytes per mesh axis, each stacked by phase."""
    rows = comm_table(plan)
    fig = new_figure(10.0, 3.8)
    phases = [p for p in PHASES if any(row["phase"] == p for row in rows)]
    for col, (key, value, title) in enumerate(
        (
            ("collective", "count", "calls by collective"),
            ("axes", "bytes/rank", "bytes received per rank by mesh axis"),
        )
    ):
        ax = fig.add_subplot(1, 2, col + 1)
        data = _by(rows, key, value)
        labels = sorted(data)
        bottom = np.zeros(len(labels))
        for ph in phases:
            heights = np.array([data[k].get(ph, 0.0) for k in labels])
            ax.bar(
                labels,
                heights,
                bottom=bottom,
                label=ph,
                color=PHASE_COLORS[ph],
                hatch=PHASE_HATCH[ph],
                edgecolor="white",
            )
            bottom += heights
        ax.set_title(title, fontsize=10)
        if value == "bytes/rank" and labels:
            top = float(bottom.max()) if len(bottom) else 0.0
            for i, total in enumerate(bottom):
                ax.text(i, total, fmt_bytes(total), ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, top * 1.15 or 1)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        if not labels:
            ax.text(0.5, 0.5, "no communication", ha="center", va="center", transform=ax.transAxes)
        if phases:
            ax.legend(fontsize=8)
    return fig


def traffic_matrix(plan: Plan, phase: str | None = None) -> tuple[list[int], np.ndarray]:
    """``(ranks, m)`` with ``m[i, j]``: bytes ``ranks[i]`` receives from ``ranks[j]`` (module docstring)."""
    ranks = all_ranks(plan)
    index = {r: i for i, r in enumerate(ranks)}
    m = np.zeros((len(ranks), len(ranks)))
    for r in plan.reshards:
        if phase is not None and r.phase != phase:
            continue
        mesh = plan_mesh(plan, r.src_mesh)
        for s in r.steps:
            if s.kind == "transfer":
                for src, dst, nbytes in s.pieces:
                    if src != dst:
                        m[index[dst], index[src]] += nbytes
            elif s.kind in COMM_KINDS and s.axes:
                groups = np.asarray(mesh.groups([mesh.dim_names.index(a) for a in s.axes]))
                n = groups.shape[1]
                if n < 2:
                    continue
                share = s.bytes_per_rank / (n - 1)
                idx = np.vectorize(index.__getitem__)(groups) if groups.size else groups
                for g in idx:  # one block per group: every member from every other member
                    m[np.ix_(g, g)] += share
                    m[g, g] -= share
    return ranks, m


def traffic_figure(plan: Plan, phase: str | None = None) -> Figure:
    ranks, m = traffic_matrix(plan, phase)
    fig = new_figure(6.4, 5.4)
    ax = fig.add_subplot()
    if not ranks or not m.any():
        empty_notice(ax, "no traffic" + (f" in {phase}" if phase else ""))
        return fig
    positive = m[m > 0]
    image = ax.imshow(
        np.where(m > 0, m, np.nan),
        cmap="viridis",
        interpolation="nearest",
        norm=LogNorm(vmin=float(positive.min()), vmax=float(positive.max())),
    )
    fig.colorbar(image, ax=ax, label="bytes received (log scale)")
    step = max(1, len(ranks) // 16)
    ticks = list(range(0, len(ranks), step))
    ax.set_xticks(ticks, [str(ranks[i]) for i in ticks], fontsize=7)
    ax.set_yticks(ticks, [str(ranks[i]) for i in ticks], fontsize=7)
    ax.set_xlabel("from rank")
    ax.set_ylabel("to rank")
    total = float(m.sum())
    ax.set_title(f"rank x rank traffic{' (' + phase + ')' if phase else ''}: {fmt_bytes(total)} in all", fontsize=10)
    return fig


def comm_text(plan: Plan) -> str:
    rows = comm_table(plan)
    lines = ["communication by phase, collective and mesh axes (bytes received per rank, busiest rank):"]
    if not rows:
        lines.append("  (none)")
    for row in rows:
        lines.append(
            f"  {row['phase']:<9} {row['collective']:<15} {row['axes']:<10} x{row['count']:<4} "
            f"{fmt_bytes(row['bytes/rank']):>12}"
        )
    for ph in PHASES:
        sub = [row for row in rows if row["phase"] == ph]
        if sub:
            lines.append(
                f"  total {ph}: {sum(r['count'] for r in sub)} call(s), "
                f"{fmt_bytes(sum(r['bytes/rank'] for r in sub))} per rank"
            )
    colors = ", ".join(f"{k}" for k in COLLECTIVE_COLORS if any(r["collective"] == k for r in rows))
    if colors:
        lines.append(f"  collectives used: {colors}")
    return "\n".join(lines) + "\n"
