"""Reshard speed in the simulator: each transition vs a plain NumPy copy, and planner time.

    .venv/bin/python benchmarks/reshard.py [--mib 64]

For a float32 tensor of ``--mib`` MiB on an 8-rank virtual mesh, prints each transition's
time as a ratio to ``np.copyto`` of the tensor's bytes, measured in the same run (target: at
most 3x for the collectives), and to a copy of the bytes the transition must read (the
simulator reads every hosted shard: a Partial tensor on 8 ranks is 8 full-size buffers, so
reductions are bounded below by reading 8x the tensor). Then the planner's time per plan on
3-d meshes, uncached and cached.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from results import add_json_argument, record

import mpipar as dist
from mpipar.reshard.planner import _plan_cached
from simulator import SimBackend


def best_of(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    dist.set_backend(SimBackend(64))
    n = args.mib * 2**20 // 4
    rows = 1024
    value = np.random.default_rng(0).random((rows, n // rows), dtype=np.float32)
    scratch = np.empty_like(value)
    copy_time = best_of(lambda: np.copyto(scratch, value), args.repeat)
    print(f"tensor {list(value.shape)} float32 = {value.nbytes / 2**20:.0f} MiB; np.copyto: {copy_time * 1e3:.1f} ms")

    mesh8 = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    mesh222 = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["x", "y", "z"])
    mesh_a = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    mesh_b = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])
    p = dist.parse_placements
    cases = [
        ("S(0) -> R", mesh8, "S(0)", mesh8, "R", True),
        ("P -> R", mesh8, "P(sum)", mesh8, "R", True),
        ("P -> S(0)", mesh8, "P(sum)", mesh8, "S(0)", True),
        ("S(0) -> S(1)", mesh8, "S(0)", mesh8, "S(1)", True),
        ("R -> S(0)", mesh8, "R", mesh8, "S(0)", False),
        ("2x2x2 PPP -> RRR", mesh222, "P(sum)P(sum)P(sum)", mesh222, "RRR", True),
        ("2x2x2 S0S1R -> S1S0R", mesh222, "S(0)S(1)R", mesh222, "S(1)S(0)R", True),
        ("stage [0..3] R -> [4..7] R", mesh_a, "R", mesh_b, "R", True),
    ]
    print(f"{'transition':30s} {'time ms':>9s} {'x copy':>7s} {'x copy of bytes read':>21s}  steps")
    for name, m0, s0, m1, s1, is_comm in cases:
        x = dist.shard_tensor(value, m0, p(s0))
        plan = dist.plan_reshard(x.spec, dist.DistSpec(value.shape, m1, p(s1)))
        t = best_of(lambda x=x, m1=m1, s1=s1: dist.reshard(x, m1, p(s1)), args.repeat)
        read = sum(a.nbytes for a in x._shards.values() if a is not None) if x.spec.is_partial else value.nbytes
        read_ratio = t / (copy_time * read / value.nbytes)
        flag = ""
        if is_comm and t / copy_time > 3:
            flag = "  (above 3x: reads every rank's partial buffer)" if x.spec.is_partial else "  (above 3x)"
        steps = " + ".join(s.kind for s in plan.steps)
        print(f"{name:30s} {t * 1e3:9.1f} {t / copy_time:7.2f} {read_ratio:21.2f}  {steps}{flag}")

    print("\nplanner time per plan on 3-d meshes")
    mesh_big = dist.ProcessMesh(np.arange(64).reshape(4, 4, 4), dim_names=["x", "y", "z"])
    shape = (64, 48, 32)
    pairs = [
        ("S(0)S(1)S(2)", "S(2)S(0)S(1)"),
        ("P(sum)P(sum)P(sum)", "S(0)RR"),
        ("S(0)S(0)R", "RS(1)S(0)"),
        ("RRR", "S(0)S(1)P(sum)"),
    ]
    for src, dst in pairs:
        a, b = dist.DistSpec(shape, mesh_big, p(src)), dist.DistSpec(shape, mesh_big, p(dst))
        _plan_cached.cache_clear()
        t_cold = best_of(lambda a=a, b=b: (_plan_cached.cache_clear(), dist.plan_reshard(a, b)), args.repeat)
        dist.plan_reshard(a, b)
        t_warm = best_of(lambda a=a, b=b: dist.plan_reshard(a, b), 100)
        steps = len(dist.plan_reshard(a, b).steps)
        print(
            f"  4x4x4 {src:>20s} -> {dst:<16s} uncached {t_cold * 1e3:7.2f} ms  cached {t_warm * 1e6:6.2f} us  ({steps} steps)"
        )


if __name__ == "__main__":
    main()
