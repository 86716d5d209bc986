"""A small training-like loop of reshards in which one rank misbehaves, for the fault tests.

    mpiexec -n 4 python tests/mpi_scripts/faults.py raise --rank 1
    MPIPAR_CHECK_COLLECTIVES=1 mpiexec -n 4 python tests/mpi_scripts/faults.py skip --rank 1
    mpiexec -n 4 python tests/mpi_scripts/faults.py kill --rank 1
    MPIPAR_TIMEOUT=3 mpiexec -n 4 python tests/mpi_scripts/faults.py hang --rank 2
    mpiexec -n 4 python tests/mpi_scripts/faults.py exit --rank 1

Each step gathers a sharded tensor (all_gather) and sums a partial one (all_reduce) on a
1-d mesh of every rank. At step 2 the chosen rank misbehaves while the others go on into
the step's collectives:

* ``raise``: raises ``RuntimeError("boom on rank N")``;
* ``skip``: skips the all_gather (its next collective is the all_reduce);
* ``kill``: sends itself SIGKILL;
* ``hang``: sleeps for ten minutes before its collectives;
* ``exit``: leaves the script normally (exit status 0) without the step's collectives;
* ``max``: reduces its Partial with ``max`` while the others sum (same bytes, same shape);
* ``float32``: passes float32 of twice the columns where the others pass float64 (same bytes).

With ``--no-assert`` the replicated result is not checked (a mismatch the default check
misses would then finish with exit 0, as it did before the check existed).

Rank 0 prints ``step <n> done`` after each completed step and ``finished`` at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import mpipar as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["none", "raise", "skip", "kill", "hang", "exit", "max", "float32"])
    parser.add_argument("--no-assert", action="store_true", help="do not check the reduced values")
    parser.add_argument("--rows", type=int, default=2, help="rows per rank (large: the split all-reduce)")
    parser.add_argument("--rank", type=int, default=1, help="the rank that misbehaves")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    world, me = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    value = np.arange(3.0 * args.rows * world).reshape(args.rows * world, 3)
    for step in range(args.steps):
        bad = step == 2 and me == args.rank
        if bad and args.mode == "raise":
            raise RuntimeError(f"boom on rank {me}")
        if bad and args.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if bad and args.mode == "hang":
            time.sleep(600)
        if bad and args.mode == "exit":
            sys.exit(0)
        x = dist.shard_tensor(value, mesh, [dist.Shard(0)])
        if not (bad and args.mode == "skip"):
            dist.reshard(x, mesh, [dist.Replicate()])  # all_gather
        mine = value
        if bad and args.mode == "float32":
            mine = np.ascontiguousarray(value).view(np.float32).copy()  # (2 world, 6) float32: the same bytes
        p = dist.shard_tensor(mine, mesh, [dist.Partial("max" if bad and args.mode == "max" else "sum")])
        total = dist.reshard(p, mesh, [dist.Replicate()])  # all_reduce
        if not args.no_assert:
            np.testing.assert_array_equal(total.local_tensor(me), value)
        dist.print_once(f"step {step} done")
    dist.print_once("finished")


if __name__ == "__main__":
    main()
