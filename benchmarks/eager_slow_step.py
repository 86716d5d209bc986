"""Which rank made a slow eager step slow, and where its time went: the TP MLP step of
``tp_mlp_vs_mpi4py.py`` under a measured timeline.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MPIPAR_TRACE=mlp.json \\
        .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/eager_slow_step.py [--steps 60]
    .venv/bin/python benchmarks/eager_slow_step.py --read mlp.json [--show 3] [--print-json] [--json PATH]

The first form runs the public-API step (warm-up, then ``--steps`` steps, a barrier before
each, as the benchmark times them); ``MPIPAR_TRACE`` writes every rank's op and collective
spans. The second reads such a timeline, cuts each rank's lane into steps (a step starts
with the first forward op after a backward op), and for the slowest steps (by the time
from the earliest rank's start to the latest rank's end) prints per rank: when it started,
when it reached the all-reduce, how long it waited there, when it finished, its time in op
spans and its time in none of them (Python dispatch, or the process waiting for a core), and
its op whose time was furthest above that op's median over all steps. The first ``--skip``
steps (the warm-up) are left out. ``--print-json`` prints the analysis as JSON instead;
``--json PATH`` keeps what is printed as a results record (``benchmarks/results.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

import numpy as np
from results import add_json_argument, record

from mpipar.debug.timeline import Timeline


def run(steps: int) -> None:
    from mpi4py import MPI
    from tp_mlp_vs_mpi4py import ours

    world = MPI.COMM_WORLD
    step, _ = ours(world)
    for _ in range(3):
        step()
    for _ in range(steps):
        world.Barrier()
        step()
    # MPIPAR_TRACE's timeline is written at exit, by rank 0.


def steps_of(spans: list[Any]) -> list[list[Any]]:
    """One rank's spans (in start order) cut into steps: a step begins with a forward op that
    follows an op of another phase (backward; the SGD update itself records no op)."""
    out: list[list[Any]] = []
    last_kind = ""
    for s in sorted(spans, key=lambda s: s.start):
        if s.track == "compute" and s.kind == "F" and last_kind != "F":
            out.append([])
        if out:
            out[-1].append(s)
        if s.track == "compute":
            last_kind = s.kind
    return out


def analyse(path: str, show: int, skip: int = 3) -> dict[str, Any]:
    timeline = Timeline.load(path)
    by_rank: dict[int, list[Any]] = defaultdict(list)
    for s in timeline.spans:
        by_rank[s.rank].append(s)
    per_rank = {r: steps_of(spans)[skip:] for r, spans in sorted(by_rank.items())}
    count = min(len(v) for v in per_rank.values())
    if count < 2:
        raise SystemExit(f"{path}: fewer than two steps on some rank")
    # Each op's median time over every step and rank (by its position in the step).
    op_times: dict[int, list[float]] = defaultdict(list)
    for steps in per_rank.values():
        for st in steps[:count]:
            for i, s in enumerate(x for x in st if x.track == "compute"):
                op_times[i].append(s.end - s.start)
    median = {i: float(np.median(v)) for i, v in op_times.items()}
    spans_of_step = [{r: per_rank[r][k] for r in per_rank} for k in range(count)]
    durations = [max(st[-1].end for st in s.values()) - min(st[0].start for st in s.values()) for s in spans_of_step]
    report: dict[str, Any] = {
        "steps": count,
        "step_ms": {q: float(np.percentile(durations, q)) * 1e3 for q in (10, 50, 90)},
        "slowest": [],
    }
    for k in np.argsort(durations)[::-1][:show]:
        step = spans_of_step[int(k)]
        t0 = min(st[0].start for st in step.values())
        ranks = []
        for r, st in step.items():
            compute = [s for s in st if s.track == "compute"]
            comm = [s for s in st if s.track == "comm" and s.name.startswith("all_reduce")]
            busy = sum(s.end - s.start for s in compute)
            waiting = sum(s.end - s.start for s in st if s.track == "comm")
            worst = max(range(len(compute)), key=lambda i: compute[i].end - compute[i].start - median.get(i, 0.0))
            ranks.append(
                {
                    "rank": r,
                    "start_ms": (st[0].start - t0) * 1e3,
                    "at_all_reduce_ms": (comm[0].start - t0) * 1e3 if comm else None,
                    "waited_ms": (comm[0].end - comm[0].start) * 1e3 if comm else None,
                    "end_ms": (st[-1].end - t0) * 1e3,
                    "in_ops_ms": busy * 1e3,
                    "between_ops_ms": ((st[-1].end - st[0].start) - busy - waiting) * 1e3,
                    "worst_op": compute[worst].name,
                    "worst_op_ms": (compute[worst].end - compute[worst].start) * 1e3,
                    "worst_op_median_ms": median.get(worst, 0.0) * 1e3,
                }
            )
        report["slowest"].append({"step": int(k), "ms": durations[int(k)] * 1e3, "ranks": ranks})
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--read", metavar="TIMELINE", help="analyse a timeline written by the first form")
    p.add_argument("--show", type=int, default=3, help="how many of the slowest steps to print")
    p.add_argument("--skip", type=int, default=3, help="leave out the first steps (the run's warm-up)")
    p.add_argument("--print-json", action="store_true", help="print the analysis as one JSON object")
    add_json_argument(p)
    args = p.parse_args()
    record(args.json, __file__)
    if not args.read:
        run(args.steps)
        return
    report = analyse(args.read, args.show, args.skip)
    if args.print_json:
        print(json.dumps(report, indent=1))
        return
    q = report["step_ms"]
    print(f"{report['steps']} steps: p10 {q[10]:.2f} ms, p50 {q[50]:.2f} ms, p90 {q[90]:.2f} ms")
    for slow in report["slowest"]:
        print(f"step {slow['step']}: {slow['ms']:.2f} ms (times from the first rank's start)")
        for r in slow["ranks"]:
            at = "-" if r["at_all_reduce_ms"] is None else f"{r['at_all_reduce_ms']:.2f}"
            waited = "-" if r["waited_ms"] is None else f"{r['waited_ms']:.2f}"
            print(
                f"  rank {r['rank']}: start {r['start_ms']:.2f}, at all-reduce {at}, waited {waited}, "
                f"end {r['end_ms']:.2f}; in ops {r['in_ops_ms']:.2f}, between ops {r['between_ops_ms']:.2f}; "
                f"slowest op {r['worst_op']} {r['worst_op_ms']:.2f} (median {r['worst_op_median_ms']:.2f})"
            )


if __name__ == "__main__":
    sys.exit(main())
