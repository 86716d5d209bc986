"""Strategy search in the What-if view: candidates as predicted step time vs peak memory.

    result = run_search(SearchSpace(layers=4, hidden=128, heads=4, seq=64, vocab=128,
                                    devices=8, global_batch=16, hardware="h100-nvlink-ib"))
    points = candidates(result)                  # every priced candidate, in memory and over it
    front = pareto_front(points)                 # indices: nothing else is both faster and smaller
    search_figure(points, front, result.memory_limit, selected=0)
    candidate_rows(points, front)                # the table under the scatter

The search itself is ``simulator.search.search`` (called, never changed here), kept small by
the space the view offers (ZeRO stages, recompute modes, schedules), and cached by that space.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from simulator.search import Candidate, SearchResult, search
from simulator.step_trace import GPTShape
from viz.figures import empty_notice, new_figure
from viz.planinfo import fmt_bytes

MAX_DEVICES = 64  # the search enumerates every divisor triple: keep the dashboard's answer interactive
# Upper bounds of the fields (the batch bounds the divisor loops, the shape the traced tensors).
BOUNDS = {
    "layers": 256,
    "hidden": 1 << 16,
    "heads": 1024,
    "seq": 1 << 16,
    "vocab": 1 << 20,
    "devices": MAX_DEVICES,
    "global_batch": 4096,
}


@dataclass(frozen=True)
class SearchSpace:
    """What the view asks the search (hashable: the cache key)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    devices: int
    global_batch: int
    hardware: str
    memory_limit: int | None = None
    zero_stages: tuple[int, ...] = (0,)
    recomputes: tuple[str, ...] = ("none",)
    schedules: tuple[str, ...] = ("1F1B",)
    mixed_precision: bool = False
    dropout: float = 0.0

    def check(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"search {name} must be a positive integer, got {value!r}")
            if value > bound:
                raise ValueError(
                    f"search {name} = {value}: the dashboard searches at most {bound} "
                    "(use `python -m simulator search` for more)"
                )
        if not (self.zero_stages and self.recomputes and self.schedules):
            raise ValueError("pick at least one ZeRO stage, one recompute mode and one schedule to search")


@functools.lru_cache(maxsize=16)
def run_search(space: SearchSpace) -> SearchResult:
    """Every candidate of ``space`` priced (cached by the space)."""
    space.check()
    shape = GPTShape(space.layers, space.hidden, space.heads, space.seq, space.vocab, 1, space.dropout)
    return search(
        shape,
        space.devices,
        space.global_batch,
        space.hardware,
        memory_limit=space.memory_limit,
        top_k=1 << 30,
        zero_stages=space.zero_stages,
        recomputes=space.recomputes,
        schedules=space.schedules,
        mixed_precision=space.mixed_precision,
    )


def candidates(result: SearchResult) -> list[Candidate]:
    """All priced candidates, fastest first (those over the memory limit included, marked by ``fits``)."""
    return sorted([*result.ranked, *result.over_memory], key=lambda c: (c.step_time_s, c.peak_bytes))


def pareto_front(points: list[Candidate]) -> list[int]:
    """Indices of the candidates that fit and that no other fitting one beats on both time and memory."""
    fitting = sorted(
        (i for i, c in enumerate(points) if c.fits), key=lambda i: (points[i].step_time_s, points[i].peak_bytes)
    )
    front: list[int] = []
    best_mem = float("inf")
    for i in fitting:
        if points[i].peak_bytes < best_mem:
            front.append(i)
            best_mem = points[i].peak_bytes
    return front


def candidate_label(c: Candidate) -> str:
    st = c.strategy
    extra = []
    if st.chunks > 1:
        extra.append(f"{st.chunks} chunks")
    if st.sequence_parallel:
        extra.append("SP")
    if st.zero:
        extra.append(f"ZeRO-{st.zero}")
    if st.recompute != "none":
        extra.append(f"recompute {st.recompute}")
    tail = (", " + ", ".join(extra)) if extra else ""
    return (
        f"dp={st.dp},tp={st.tp},pp={st.pp} {st.schedule} x{st.micro_batches}{tail}: "
        f"{c.step_time_s * 1e3:.3g} ms, {fmt_bytes(c.peak_bytes)}"
    )


def candidate_rows(points: list[Candidate], front: list[int]) -> list[dict[str, Any]]:
    on_front = set(front)
    return [
        {
            "#": i,
            "dp": c.strategy.dp,
            "tp": c.strategy.tp,
            "pp": c.strategy.pp,
            "schedule": c.strategy.schedule,
            "chunks": c.strategy.chunks,
            "micro-batches": c.strategy.micro_batches,
            "SP": c.strategy.sequence_parallel,
            "ZeRO": c.strategy.zero,
            "recompute": c.strategy.recompute,
            "step ms": round(c.step_time_s * 1e3, 6),
            "peak memory": fmt_bytes(c.peak_bytes),
            "bubble": f"{c.bubble_fraction:.1%}",
            "fits": c.fits,
            "Pareto": i in on_front,
        }
        for i, c in enumerate(points)
    ]


def search_figure(
    points: list[Candidate], front: list[int], memory_limit: int | None, selected: int | None = None
) -> Figure:
    """Scatter: peak memory (x) vs predicted step time (y); the Pareto front joined, the limit drawn."""
    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    if not points:
        empty_notice(ax, "no candidate divides this model and device count")
        return fig
    mem = np.array([c.peak_bytes for c in points], dtype=float) / 2**20
    ms = np.array([c.step_time_s for c in points], dtype=float) * 1e3
    fits = np.array([c.fits for c in points], dtype=bool)
    ax.scatter(mem[fits], ms[fits], s=18, color="#4E79A7", alpha=0.6, label="fits")
    if (~fits).any():
        ax.scatter(mem[~fits], ms[~fits], s=22, color="#BAB0AC", marker="x", label="over the memory limit")
    if front:
        order = sorted(front, key=lambda i: mem[i])
        ax.plot(mem[order], ms[order], "-o", color="#E15759", markersize=5, linewidth=1.2, label="Pareto front")
    if memory_limit:
        ax.axvline(
            memory_limit / 2**20,
            color="black",
            linestyle="--",
            linewidth=1.0,
            label=f"memory limit {fmt_bytes(memory_limit)}",
        )
    if selected is not None and 0 <= selected < len(points):
        ax.scatter(
            [mem[selected]],
            [ms[selected]],
            s=140,
            facecolors="none",
            edgecolors="#F28E2B",
            linewidths=2,
            label="selected",
        )
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    return fig


def search_text(points: list[Candidate], front: list[int], memory_limit: int | None) -> str:
    on_front = set(front)
    lines = [
        f"{len(points)} candidates; memory limit {fmt_bytes(memory_limit) if memory_limit else 'none'}; "
        f"* = Pareto front, x = over the limit"
    ]
    for i, c in enumerate(points):
        mark = "*" if i in on_front else ("x" if not c.fits else " ")
        lines.append(f"{mark} #{i:<3} {candidate_label(c)}")
    return "\n".join(lines) + "\n"


def candidate_flags(c: Candidate, scheduled: bool) -> dict[str, Any]:
    """The candidate as the examples' knobs (``--mesh``, ``--schedule`` ...).

    With pp = 1 the search's "1F1B" is one stage: kept when the script already runs a schedule
    (``scheduled``: a ``to_static`` step, which also traces shape-only), dropped otherwise
    (the eager loop, micro-batches as gradient accumulation)."""
    st = c.strategy
    piped = st.pp > 1 or scheduled
    return {
        "dp": st.dp,
        "tp": st.tp,
        "pp": st.pp,
        "schedule": st.schedule if piped else None,
        "micro_batches": st.micro_batches,
        "chunks": st.chunks if st.chunks > 1 else 2,
        "zero": st.zero,
        "recompute": st.recompute,
        "sequence_parallel": st.sequence_parallel,
    }


def gpt_example_space(args: list[str] | tuple[str, ...], devices: int, hardware: str) -> SearchSpace:
    """The model ``examples/gpt.py`` builds for these arguments (its two configurations, restated here:
    the search prices a GPT shape, the script only runs one)."""

    def value(flag: str) -> str | None:
        found = None
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(flag + "="):
                found = a[len(flag) + 1 :]
        return found

    batch_text = value("--batch-size")
    batch = int(batch_text) if batch_text and batch_text.isdigit() and 0 < len(batch_text) < 10 else None
    if batch is not None and not 0 < batch <= BOUNDS["global_batch"]:
        batch = None  # an out-of-range recorded batch (the plan is untrusted): the example's default instead
    if "--tiny" in args:
        return SearchSpace(2, 16, 2, 16, 128, devices, batch or 8, hardware, dropout=0.1)
    return SearchSpace(4, 128, 4, 64, 128, devices, batch or 16, hardware)
