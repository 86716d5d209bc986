"""Memory view: one rank's bytes over the step stacked by category, the peak, the device capacity.

    memory_figure(curve, capacity=80 * 2**30)       # a MemoryCurve (from a timeline)
    rank_peaks(plan)                                 # per rank: bytes by category at its peak
    peaks_figure(rank_peaks(plan), capacity)         # every rank's peak, stacked
    print(memory_text(curve, capacity))

Curves are step functions (``mpipar.timeline``): a category's bytes hold from one time to the
next. A rank's curve comes from the timeline (predicted or measured), or is simulated from the
plan's memory section for that rank (``viz.simulate``). Peaks over all ranks simulate each
distinct memory signature once (ranks of one lane with the same bytes share a curve), so a
1024-rank plan costs a handful of simulations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.figure import Figure

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import MEMORY_CATEGORIES, MemoryCurve
from viz.figures import MEMORY_COLORS, empty_notice, new_figure
from viz.planinfo import fmt_bytes
from viz.simulate import lane_of_rank, rank_memory, simulate_plan


def _gib_axis(values: float) -> tuple[float, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if values >= scale:
            return float(scale), unit
    return 1.0, "B"


def memory_figure(
    curve: MemoryCurve, capacity: float | None = None, title: str | None = None, time_unit: str = "s"
) -> Figure:
    """Stacked step areas per category, the peak marked, the capacity as a line."""
    fig = new_figure(9.0, 3.8)
    ax = fig.add_subplot()
    times = np.asarray(curve.times, dtype=float)
    end = times[-1] + (times[-1] - times[0]) * 0.05 if len(times) > 1 else times[-1] + 1.0
    xs = np.append(times, end)
    peak_t, peak, at_peak = curve.peak()
    scale, unit = _gib_axis(max(peak, capacity or 0.0))
    bottom = np.zeros(len(xs))
    for cat in [c for c in MEMORY_CATEGORIES if c in curve.bytes]:
        vals = np.append(np.asarray(curve.bytes[cat], dtype=float), curve.bytes[cat][-1]) / scale
        ax.fill_between(xs, bottom, bottom + vals, step="post", color=MEMORY_COLORS[cat], label=cat, linewidth=0)
        bottom = bottom + vals
    ax.axvline(peak_t, color="black", linestyle=":", linewidth=1)
    ax.annotate(
        f"peak {fmt_bytes(peak)}", (peak_t, peak / scale), xytext=(5, 5), textcoords="offset points", fontsize=8
    )
    top = peak / scale
    if capacity:
        ax.axhline(
            capacity / scale, color="#D62728", linestyle="--", linewidth=1.2, label=f"capacity {fmt_bytes(capacity)}"
        )
        top = max(top, capacity / scale)
    ax.set_ylim(0, top * 1.15 or 1)
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylabel(unit)
    ax.set_xlabel("time units" if time_unit == "unit" else "seconds")
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    parts = ", ".join(f"{c} {fmt_bytes(v)}" for c, v in at_peak.items() if v)
    ax.set_title((title or f"rank {curve.rank} memory") + f"\nat peak: {parts or 'nothing'}", fontsize=9)
    return fig


def rank_peaks(plan: Plan, kind: str | None = None, microbatches: int | None = None) -> list[dict[str, Any]]:
    """Per rank of the plan's memory section: bytes by category at the rank's peak, and the peak."""
    entries = [e for e in (plan.memory or {}).get("ranks", []) or [] if isinstance(e, dict) and "rank" in e]
    cache: dict[tuple[Any, ...], tuple[float, dict[str, float]]] = {}
    rows = []
    for e in entries:
        rank = int(e["rank"])
        lane = lane_of_rank(plan, rank)
        signature = (
            lane,
            *(repr(e.get(k)) for k in ("parameters", "gradients", "optimizer_state", "activations", "messages")),
        )
        if signature not in cache:
            if lane is None:
                state = {c: float(e.get(c, 0.0) or 0.0) for c in ("parameters", "gradients", "optimizer_state")}
                cache[signature] = (sum(state.values()), state)
            else:
                t = simulate_plan(plan, kind, microbatches, memory_rank=rank)
                curve = t.memory[lane] if t.memory else None
                if curve is None:
                    cache[signature] = (0.0, {})
                else:
                    _, peak, at = curve.peak()
                    cache[signature] = (peak, dict(at))
        peak, at = cache[signature]
        rows.append({"rank": rank, "lane": lane, **{c: at.get(c, 0.0) for c in MEMORY_CATEGORIES}, "peak": peak})
    return rows


def rank_curve(plan: Plan, rank: int, kind: str | None = None, microbatches: int | None = None) -> MemoryCurve | None:
    """The simulated memory curve of ``rank`` (None without a memory entry or pipeline for it)."""
    lane = lane_of_rank(plan, rank)
    if lane is None or rank_memory(plan, rank) is None:
        return None
    t = simulate_plan(plan, kind, microbatches, memory_rank=rank)
    if not t.memory or lane not in t.memory:
        return None
    c = t.memory[lane]
    return MemoryCurve(rank, c.times, c.bytes)


def peaks_figure(rows: list[dict[str, Any]], capacity: float | None = None) -> Figure:
    """Every rank's peak stacked by category (one filled band per category, whatever the rank count)."""
    fig = new_figure(9.0, 3.4)
    ax = fig.add_subplot()
    if not rows:
        empty_notice(ax, "no per-rank memory in this plan")
        return fig
    rows = sorted(rows, key=lambda r: r["rank"])
    peak = max(r["peak"] for r in rows)
    scale, unit = _gib_axis(max(peak, capacity or 0.0))
    x = np.arange(len(rows) + 1) - 0.5
    bottom = np.zeros(len(rows))
    for cat in MEMORY_CATEGORIES:
        vals = np.array([r[cat] for r in rows], dtype=float) / scale
        if not vals.any():
            continue
        ax.stairs(bottom + vals, x, baseline=bottom, fill=True, color=MEMORY_COLORS[cat], label=cat)
        bottom = bottom + vals
    if capacity:
        ax.axhline(
            capacity / scale, color="#D62728", linestyle="--", linewidth=1.2, label=f"capacity {fmt_bytes(capacity)}"
        )
    ax.set_ylim(0, max(peak, capacity or 0.0) / scale * 1.15 or 1)
    step = max(1, len(rows) // 16)
    ax.set_xticks(range(0, len(rows), step), [str(rows[i]["rank"]) for i in range(0, len(rows), step)], fontsize=7)
    ax.set_xlabel("rank")
    ax.set_ylabel(unit)
    worst = max(rows, key=lambda r: r["peak"])
    ax.set_title(f"peak memory per rank (highest: rank {worst['rank']}, {fmt_bytes(worst['peak'])})", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left")
    return fig


def memory_text(curve: MemoryCurve, capacity: float | None = None) -> str:
    t, peak, at = curve.peak()
    lines = [f"rank {curve.rank}: peak {fmt_bytes(peak)} at t={t:.4g}"]
    for c, v in at.items():
        lines.append(f"  {c:<16} {fmt_bytes(v):>12}")
    if capacity:
        lines.append(
            f"  capacity {fmt_bytes(capacity)}: {'FITS' if peak <= capacity else 'DOES NOT FIT'} "
            f"({peak / capacity:.1%} used)"
        )
    return "\n".join(lines) + "\n"
