"""What-if view: re-trace the sample with other knobs (shape-only, cached) and diff it against the loaded plan.

    plan_b, timeline_b = whatif_sample(dp=4, tp=2, pp=2, schedule="ZBH1", microbatches=8)
    rows = diff_rows(plan_metrics(plan_a, timeline_a), plan_metrics(plan_b, timeline_b))
    diff_figure(rows); print(diff_text(rows))

Metrics compared: world size, collective calls per kind and in all, bytes received per rank
by phase, step time, bubble share, peak memory over all ranks. Re-tracing runs the sample's
model in shape-only mode (no values), so a 1024-rank mesh takes about a second; results are
cached by knob values (``functools.lru_cache``: the same knobs never re-trace).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from mpipar.compile.plan import PHASES, Plan
from mpipar.debug.timeline import Timeline
from viz.figures import empty_notice, new_figure
from viz.memory import rank_peaks
from viz.planinfo import all_ranks, fmt_bytes
from viz.sample import build_sample


@functools.lru_cache(maxsize=64)
def whatif_sample(
    dp: int,
    tp: int,
    pp: int,
    schedule: str,
    microbatches: int,
    zero: int = 0,
    recompute: str = "none",
    hidden: int = 256,
    batch: int = 32,
    profile: str = "cpu-local",
) -> tuple[Plan, Timeline]:
    """The sample re-traced shape-only with these knobs (cached)."""
    return build_sample(
        dp,
        tp,
        pp,
        schedule,
        microbatches,
        zero,
        recompute,
        shape_only=True,
        hidden=hidden,
        batch=batch,
        profile=profile,
    )


def plan_metrics(plan: Plan, timeline: Timeline | None) -> dict[str, Any]:
    counts = plan.comm_counts()
    metrics: dict[str, Any] = {"world size": len(all_ranks(plan)), "collective calls": sum(counts.values())}
    for kind, n in sorted(counts.items()):
        metrics[f"  {kind} calls"] = n
    for ph in PHASES:
        b = plan.comm_bytes(ph)
        if b or ph in ("forward", "backward"):
            metrics[f"{ph} bytes/rank"] = b
    if timeline is not None:
        metrics["step time"] = timeline.makespan
        metrics["bubble share"] = timeline.bubble_fraction()
    peaks = rank_peaks(plan) if plan.memory else []
    if peaks:
        metrics["peak memory"] = max(r["peak"] for r in peaks)
    elif timeline is not None and timeline.memory:
        metrics["peak memory"] = max(timeline.peak_memory().values())
    metrics["_time_unit"] = timeline.time_unit if timeline is not None else None
    return metrics


def _fmt(metric: str, value: Any, unit: str | None) -> str:
    if value is None:
        return "-"
    if "bytes" in metric or metric == "peak memory":
        return fmt_bytes(value)
    if metric == "bubble share":
        return f"{value:.1%}"
    if metric == "step time":
        return f"{value:.4g} {unit or ''}".strip()
    return str(value)


def diff_rows(base: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric in either: loaded, what-if, their ratio (what-if / loaded)."""
    keys = [k for k in base if not k.startswith("_")] + [k for k in new if k not in base and not k.startswith("_")]
    rows = []
    for k in keys:
        a, b = base.get(k), new.get(k)
        ratio = None
        if isinstance(a, int | float) and isinstance(b, int | float) and a:
            ratio = b / a
        comparable = k != "step time" or base.get("_time_unit") == new.get("_time_unit")
        rows.append(
            {
                "metric": k.strip() if not k.startswith("  ") else k,
                "loaded": _fmt(k, a, base.get("_time_unit")),
                "what-if": _fmt(k, b, new.get("_time_unit")),
                "what-if / loaded": f"{ratio:.3g}x" if ratio is not None and comparable else "-",
                "_ratio": ratio if comparable else None,
            }
        )
    return rows


def diff_figure(rows: list[dict[str, Any]]) -> Figure:
    """What-if / loaded ratio per metric (log scale; 1 = unchanged)."""
    data = [(r["metric"].strip(), r["_ratio"]) for r in rows if r["_ratio"] is not None and r["_ratio"] > 0]
    fig = new_figure(8.0, 0.6 + 0.32 * max(len(data), 2))
    ax = fig.add_subplot()
    if not data:
        empty_notice(ax, "no comparable metrics")
        return fig
    names = [d[0] for d in data]
    ratios = np.array([d[1] for d in data], dtype=float)
    colors = ["#59A14F" if r < 1 else "#E15759" if r > 1 else "#BAB0AC" for r in ratios]
    y = np.arange(len(names))
    ax.barh(y, np.log2(ratios), color=colors)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    lim = max(1.0, float(np.abs(np.log2(ratios)).max()) * 1.2)
    ax.set_xlim(-lim, lim)
    ticks = np.arange(-np.floor(lim), np.floor(lim) + 1)
    ax.set_xticks(ticks, [f"{2.0**t:g}x" for t in ticks], fontsize=8)
    ax.set_xlabel("what-if / loaded (green: less, red: more)")
    return fig


def diff_text(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'metric':<24} {'loaded':>14} {'what-if':>14} {'ratio':>8}"]
    for r in rows:
        lines.append(f"{r['metric']:<24} {r['loaded']:>14} {r['what-if']:>14} {r['what-if / loaded']:>8}")
    return "\n".join(lines) + "\n"
