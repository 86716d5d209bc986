"""The estimator at scale: seconds for ``python -m simulator estimate`` on GPT-3 175B (target: under 30 s at 1024 ranks).

    .venv/bin/python benchmarks/estimate_scale.py [--repeat 3]

Runs the estimate in this process (trace shape-only, price, simulate the schedule) for GPT-3
175B with sequence parallel, selective recompute, ZeRO-1, mixed precision and 1F1B over 64
micro-batches, on growing meshes, and prints the best of ``--repeat`` wall times with the
split between tracing and pricing, and each one's ratio to the 64-rank run measured in the
same process. The 1024-rank line (dp 8 x tp 8 x pp 16) is the acceptance configuration; then
the same command line through ``python -m simulator estimate`` (a fresh interpreter:
imports included).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from results import add_json_argument, record

from simulator.estimate import estimate
from simulator.step_trace import GPTShape, GPTStrategy, trace_gpt_step

MESHES = [(1, 8, 8), (2, 8, 16), (8, 8, 16), (32, 8, 16)]


def best_of(repeat: int, dp: int, tp: int, pp: int) -> tuple[float, float, int]:
    shape = GPTShape.from_params(175e9)
    strategy = GPTStrategy(
        dp=dp,
        tp=tp,
        pp=pp,
        sequence_parallel=True,
        recompute="selective",
        zero=1,
        mixed_precision=True,
        micro_batches=64,
        schedule="1F1B",
    )
    best = (float("inf"), 0.0, 0)
    for _ in range(repeat):
        started = time.perf_counter()
        step = trace_gpt_step(shape, strategy)
        traced = time.perf_counter() - started
        est = estimate(shape, strategy, step=step)
        total = time.perf_counter() - started
        if total < best[0]:
            best = (total, traced, len(est.peak_bytes_per_rank))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    add_json_argument(parser)
    ns = parser.parse_args()
    record(ns.json, __file__)
    print(f"{'ranks':>6} {'dp x tp x pp':>13} {'total s':>8} {'trace s':>8} {'price s':>8} {'vs 64 ranks':>11}")
    base = None
    for dp, tp, pp in MESHES:
        total, traced, ranks = best_of(ns.repeat, dp, tp, pp)
        base = base or total
        print(
            f"{ranks:>6} {f'{dp} x {tp} x {pp}':>13} {total:>8.2f} {traced:>8.2f} {total - traced:>8.2f} {total / base:>10.2f}x"
        )
    cmd = [
        sys.executable,
        "-m",
        "simulator",
        "estimate",
        "--params",
        "175e9",
        "--mesh",
        "dp=8,tp=8,pp=16",
        "--sequence-parallel",
        "--recompute",
        "selective",
        "--zero",
        "1",
        "--mixed-precision",
        "--micro-batches",
        "64",
        "--schedule",
        "1F1B",
        "--json",
    ]
    started = time.perf_counter()
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    wall = time.perf_counter() - started
    print(
        f"python -m simulator estimate (1024 ranks, fresh interpreter): {wall:.2f} s "
        f"({wall / 30:.2f} of the 30 s budget; {os.cpu_count()} CPUs, shared)"
    )


if __name__ == "__main__":
    main()
