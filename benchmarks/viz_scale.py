"""Dashboard at scale: seconds each view takes on a 1024-rank shape-only plan (target: under 5 s each).

    .venv/bin/python benchmarks/viz_scale.py [--dp 32 --tp 16 --pp 2]

Prints the time to trace and simulate the plan, to load it back from JSON, and for each view
to build its figure(s) and render them to PNG (what a browser waits for), next to the same
view on the 8-rank sample measured in the same run (the ratio shows how the view scales).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from results import add_json_argument, record

from mpipar.compile.plan import Plan
from mpipar.debug.timeline import Timeline
from viz import comm, layout, memory, propagation, stepper, timeline_view, whatif
from viz.figures import to_png
from viz.files import load_document
from viz.planinfo import tensor_spec
from viz.sample import build_sample
from viz.simulate import simulate_plan_lanes


def _views(plan: Plan, timeline: Timeline) -> dict[str, Callable[[], object]]:
    w = next(t for t in plan.tensors if t.kind == "parameter" and len(t.shape) == 2)
    spec = tensor_spec(plan, w)
    assert spec is not None
    handoff = next(r for r in plan.reshards if any(s.kind == "transfer" for s in r.steps))
    last = max(r for m in plan.meshes for r in m.process_ids)

    def layout_view() -> object:
        return [to_png(layout.tensor_tiles_figure(spec, w.name)), to_png(layout.mesh_grid_figure(spec, 4, w.name))]

    def pipeline_view() -> object:
        other = simulate_plan_lanes(plan, "ZBH1")
        return [
            to_png(timeline_view.timeline_figure(timeline)),
            to_png(timeline_view.side_by_side_figure(timeline, other)),
        ]

    def memory_view() -> object:
        return [
            to_png(memory.memory_figure(memory.rank_curve(plan, last), 80 * 2**30)),
            to_png(memory.peaks_figure(memory.rank_peaks(plan), 80 * 2**30)),
        ]

    def whatif_view() -> object:
        whatif.whatif_sample.cache_clear()
        p, t = whatif.whatif_sample(4, 2, 2, "ZBH1", 8)
        return to_png(
            whatif.diff_figure(whatif.diff_rows(whatif.plan_metrics(plan, timeline), whatif.plan_metrics(p, t)))
        )

    return {
        "layout": layout_view,
        "propagation": lambda: propagation.trace_rows(plan),
        "stepper": lambda: [to_png(stepper.stepper_figure(plan, handoff, i)) for i in range(len(handoff.steps))],
        "communication": lambda: [to_png(comm.comm_figure(plan)), to_png(comm.traffic_figure(plan))],
        "pipeline": pipeline_view,
        "memory": memory_view,
        "what-if": whatif_view,
    }


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=32)
    parser.add_argument("--tp", type=int, default=16)
    parser.add_argument("--pp", type=int, default=2)
    add_json_argument(parser)
    ns = parser.parse_args(argv)
    record(ns.json, __file__)
    start = time.perf_counter()
    plan, timeline = build_sample(ns.dp, ns.tp, ns.pp, "1F1B", 8, shape_only=True, hidden=1024, batch=64)
    ranks = ns.dp * ns.tp * ns.pp
    print(f"trace + simulate {ranks} ranks (shape-only): {time.perf_counter() - start:.2f} s")
    data = json.dumps(plan.to_dict()).encode()
    print(f"load back from JSON ({len(data) / 2**20:.1f} MiB): {_time(lambda: load_document(data, 'plan.json')):.2f} s")
    small_plan, small_t = build_sample(2, 2, 2, "1F1B", 8)
    small = _views(small_plan, small_t)
    worst = 0.0
    print(f"{'view':<14} {ranks:>5} ranks      8 ranks   ratio")
    for name, fn in _views(plan, timeline).items():
        big_s, small_s = _time(fn), _time(small[name])
        worst = max(worst, big_s)
        print(f"{name:<14} {big_s:>9.2f} s  {small_s:>9.2f} s  {big_s / small_s:>6.1f}x")
    print(f"slowest view: {worst:.2f} s ({'under' if worst < 5 else 'OVER'} the 5 s target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
