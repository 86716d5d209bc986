"""Pipeline timeline view: a lane per rank, bars coloured by action kind, send -> recv links, bubbles.

    timeline_figure(t)                         # lanes, micro-batch labels, links, bubble per lane
    timeline_figure(predicted, overlay=measured)   # measured drawn as outlines over the prediction
    side_by_side_figure(t_1f1b, t_zbh1)        # two schedules, one time axis
    bubble_rows(t); print(timeline_text(t)); chrome_trace_bytes(t)

Each lane has the compute track (tall bars: F, B, W, OPT, ...) and under it the comm track
(thin bars: SEND, RECV, COLL). A compute bar is labelled with its micro-batch while the
figure has few enough bars to read; links join each send to the receive that matches it (the
pipeline token grammar of ``mpipar.pipeline``). Bars of one kind are one collection, so a
timeline of any size draws a bounded number of artists. When the predicted and the measured
timelines are in different units (``unit`` vs ``s``) both are scaled to their own step time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.collections import LineCollection, PatchCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from mpipar.debug.timeline import Span, Timeline
from mpipar.pipeline import matching, parse_action
from viz.figures import KIND_COLORS, new_figure
from viz.planinfo import fmt_ranks

MAX_SPAN_LABELS = 400
COMPUTE_Y, COMPUTE_H = -0.42, 0.5
COMM_Y, COMM_H = 0.12, 0.25


def lane_labels(timeline: Timeline) -> dict[int, str]:
    """``lane 0 (ranks 0-3)`` when the timeline's meta maps lanes to the ranks of a stage mesh."""
    ranks = timeline.meta.get("lane_ranks") if isinstance(timeline.meta, Mapping) else None
    out = {}
    for r in timeline.ranks:
        members = ranks.get(str(r)) if isinstance(ranks, Mapping) else None
        out[r] = f"lane {r} (ranks {fmt_ranks(members, 4)})" if isinstance(members, list) else f"rank {r}"
    return out


def _action_key(span: Span) -> tuple[str, int, int] | None:
    try:
        a = parse_action(span.name)
    except ValueError:
        return None
    return a.key


def send_recv_links(timeline: Timeline) -> list[tuple[Span, Span]]:
    """(send span, matching receive span) pairs."""
    recvs: dict[tuple[str, int, int], Span] = {}
    for s in timeline.spans:
        if s.kind == "RECV" and (key := _action_key(s)) is not None:
            recvs[key] = s
    links = []
    for s in timeline.spans:
        if s.kind != "SEND" or (key := _action_key(s)) is None:
            continue
        other = matching(parse_action(s.name))
        recv = recvs.get(other.key)
        if recv is not None:
            links.append((s, recv))
    return links


def bubble_rows(timeline: Timeline) -> list[dict[str, Any]]:
    """Per lane: busy and idle compute time and the bubble share of the step."""
    return [
        {"rank": r, "busy": timeline.busy(r), "bubble": timeline.bubble(r), "bubble share": timeline.bubble_fraction(r)}
        for r in timeline.ranks
    ]


def _scale(timeline: Timeline, normalize: bool) -> tuple[float, float]:
    """(origin, factor) mapping the timeline's times to the plotted axis."""
    if not normalize:
        return timeline.start, 1.0
    return timeline.start, 1.0 / timeline.makespan if timeline.makespan > 0 else 1.0


def draw_lanes(
    ax: Any,
    timeline: Timeline,
    *,
    overlay: Timeline | None = None,
    labels: bool = True,
    normalize: bool = False,
    title: str | None = None,
) -> None:
    """Draw ``timeline`` on ``ax`` (see the module docstring); ``overlay`` as outlined bars."""
    lanes = {r: i for i, r in enumerate(timeline.ranks)}
    origin, factor = _scale(timeline, normalize)
    by_kind: dict[str, list[Rectangle]] = {}
    compute = [s for s in timeline.spans if s.track == "compute"]
    for s in timeline.spans:
        y = lanes[s.rank] + (COMPUTE_Y if s.track == "compute" else COMM_Y)
        h = COMPUTE_H if s.track == "compute" else COMM_H
        by_kind.setdefault(s.kind, []).append(
            Rectangle(((s.start - origin) * factor, y), (s.end - s.start) * factor, h)
        )
    for kind, rects in by_kind.items():
        ax.add_collection(
            PatchCollection(rects, facecolor=KIND_COLORS.get(kind, "#999999"), edgecolor="white", linewidth=0.5)
        )
    if labels and len(compute) <= MAX_SPAN_LABELS:
        for s in compute:
            if s.microbatch is None:
                continue
            ax.text(
                (s.start + s.end - 2 * origin) / 2 * factor,
                lanes[s.rank] + COMPUTE_Y + COMPUTE_H / 2,
                str(s.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )
    links = send_recv_links(timeline)
    if links:
        segs = [
            [
                ((a.start - origin) * factor, lanes[a.rank] + COMM_Y + COMM_H / 2),
                ((b.end - origin) * factor, lanes[b.rank] + COMM_Y + COMM_H / 2),
            ]
            for a, b in links
            if a.rank in lanes and b.rank in lanes
        ]
        ax.add_collection(LineCollection(segs, colors="#555555", linewidths=0.6, alpha=0.6))
    if overlay is not None:
        o_origin, o_factor = _scale(overlay, normalize)
        rects = []
        colors = []
        for s in overlay.spans:
            if s.rank not in lanes or s.track != "compute":
                continue
            rects.append(
                Rectangle(
                    ((s.start - o_origin) * o_factor, lanes[s.rank] + COMPUTE_Y - 0.04),
                    (s.end - s.start) * o_factor,
                    COMPUTE_H + 0.08,
                )
            )
            colors.append(KIND_COLORS.get(s.kind, "#333333"))
        if rects:
            ax.add_collection(PatchCollection(rects, facecolor="none", edgecolor=colors, linewidth=1.2, linestyle="--"))
    end = max(timeline.makespan * factor, (overlay.makespan * _scale(overlay, normalize)[1]) if overlay else 0.0)
    ax.set_xlim(0, end * 1.12 if end > 0 else 1)
    ax.set_ylim(len(lanes) - 0.5, -0.6)
    label_of = lane_labels(timeline)
    step = max(1, len(lanes) // 24)
    ticks = list(timeline.ranks)[::step]
    ax.set_yticks([lanes[r] for r in ticks], [label_of[r] for r in ticks], fontsize=7)
    if len(lanes) <= 64:
        for r, i in lanes.items():
            ax.text(end * 1.01, i, f"{timeline.bubble_fraction(r):.0%}", va="center", fontsize=7)
    unit = "fraction of the step" if normalize else ("time units" if timeline.time_unit == "unit" else "seconds")
    ax.set_xlabel(unit)
    if title is not None:
        ax.set_title(title, fontsize=10)


def _title(timeline: Timeline) -> str:
    meta = timeline.meta
    kind = meta.get("schedule", "timeline")
    m = meta.get("num_microbatches")
    unit = timeline.time_unit
    return (
        f"{kind}"
        + (f", {m} micro-batches" if m else "")
        + f": step {timeline.makespan:.4g} {unit}, bubble {timeline.bubble_fraction():.1%} (per lane at right)"
    )


def _legend(fig: Figure, kinds: Sequence[str], overlay: bool) -> None:
    handles: list[Any] = [Patch(facecolor=KIND_COLORS.get(k, "#999999"), label=k) for k in kinds]
    if overlay:
        handles.append(Patch(facecolor="none", edgecolor="#333333", linestyle="--", label="measured"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 9), fontsize=8)


def timeline_figure(timeline: Timeline, overlay: Timeline | None = None, title: str | None = None) -> Figure:
    normalize = overlay is not None and overlay.time_unit != timeline.time_unit
    fig = new_figure(11.0, 1.4 + 0.55 * min(len(timeline.ranks), 24))
    ax = fig.add_subplot()
    head = title or _title(timeline)
    if overlay is not None:
        head += f"\nmeasured (outlines): step {overlay.makespan:.4g} {overlay.time_unit}"
        if timeline.makespan > 0 and not normalize:
            head += f", measured/predicted {overlay.makespan / timeline.makespan:.2f}"
        if normalize:
            head += " (units differ: both scaled to their step)"
    draw_lanes(ax, timeline, overlay=overlay, normalize=normalize, title=head)
    kinds = sorted(
        {s.kind for s in timeline.spans} | ({s.kind for s in overlay.spans} if overlay else set()),
        key=list(KIND_COLORS).index,
    )
    _legend(fig, kinds, overlay is not None)
    return fig


def side_by_side_figure(left: Timeline, right: Timeline, titles: Sequence[str] | None = None) -> Figure:
    """Two timelines in two panels sharing the time axis (same unit) for a direct comparison."""
    normalize = left.time_unit != right.time_unit
    lanes = max(len(left.ranks), len(right.ranks))
    fig = new_figure(13.0, 1.6 + 0.55 * min(lanes, 24))
    axes = fig.subplots(1, 2, sharex=not normalize)
    names = list(titles) if titles else [_title(left), _title(right)]
    for ax, t, name in zip(axes, (left, right), names, strict=True):
        draw_lanes(ax, t, normalize=normalize, title=name)
    if not normalize:
        end = max(left.makespan, right.makespan) * 1.12
        for ax in axes:
            ax.set_xlim(0, end or 1)
    kinds = sorted({s.kind for t in (left, right) for s in t.spans}, key=list(KIND_COLORS).index)
    _legend(fig, kinds, False)
    return fig


def timeline_text(timeline: Timeline) -> str:
    lines = [_title(timeline)]
    labels = lane_labels(timeline)
    for row in bubble_rows(timeline):
        lines.append(
            f"  {labels[row['rank']]}: busy {row['busy']:.4g}, bubble {row['bubble']:.4g} ({row['bubble share']:.1%})"
        )
    links = send_recv_links(timeline)
    if links:
        lines.append(f"  {len(links)} send -> recv transfer(s)")
    return "\n".join(lines) + "\n"


def chrome_trace_bytes(timeline: Timeline) -> bytes:
    """The Chrome trace-event JSON of a timeline (Perfetto and chrome://tracing open it)."""
    return json.dumps(timeline.to_chrome_trace()).encode("utf-8")
