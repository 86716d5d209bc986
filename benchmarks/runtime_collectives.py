"""mpipar's reshard under MPI against the raw mpi4py collective on the same buffers, same run.

    mpiexec -n 8 .venv/bin/python benchmarks/runtime_collectives.py [--sizes-mib 4 64] [--reps 60]

For a float32 tensor of each size on a 1-d mesh of every rank, times

==============  ===========================================  ================================
transition      ours                                          raw mpi4py baseline
==============  ===========================================  ================================
S(0) -> R       ``dist.reshard`` (all_gather)                 ``Allgather``
P -> R          ``dist.reshard`` (all_reduce, ordered)        ``Allreduce(SUM)``
P -> S(0)       ``dist.reshard`` (reduce_scatter, ordered)    ``Reduce_scatter_block(SUM)``
S(0) -> S(1)    ``dist.reshard`` (all_to_all, packs columns)  ``Alltoall``, strided MPI datatype
==============  ===========================================  ================================

and prints ours / raw (target: at most 1.2x). The two reductions run a second time as under
``MPIPAR_REDUCE=native`` ("native", "nat."): MPI's own sum instead of our ordered one.

A middle column times our communicator call alone (``backend.comm.all_gather`` etc. on the
same buffers): the difference to the full reshard is the executor's work around it. Each
time is the slowest rank's, best of ``--reps`` (60: with 8 ranks time-sharing a few cores,
a single contender's best of 30 was now and then 10-20% above its usual value). Our ordered
reductions sum in group order (bit-identical to the simulator) where MPI uses its own order,
folding each piece in as it arrives; our S(0) -> S(1) packs the strided column blocks with
NumPy where the raw call describes them with a vector datatype. The raw calls write into
preallocated outputs; ours return a new shard each time, whose buffer comes from the
communicator's result cache (the previous call's result, dropped by the loop, is reused;
with ``MPIPAR_COMM_CACHE_MIB=0`` every result is fresh memory and pays its page faults).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI
from results import add_json_argument, record

import mpipar as dist


def timed(comm: MPI.Comm, fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Best over ``reps`` of the slowest rank's time for each of ``fns``, taken in turns so
    load from other processes hits every contender alike (after one warm-up each).

    Each round runs the contenders in a fresh random order (the same on every rank). A call
    right after one that wrote another large buffer finds its own buffers evicted from cache;
    a fixed or merely rotated order would give each contender the same predecessor every time
    (rotating [ours, comm, raw] always runs ours right after raw) and so a fixed bias.
    """
    for fn in fns:
        fn()
    order = np.random.default_rng(2026)  # same seed everywhere: all ranks call alike
    best = [float("inf")] * len(fns)
    elapsed, slowest = np.empty(1), np.empty(1)
    for _ in range(reps):
        for i in order.permutation(len(fns)):
            comm.Barrier()
            start = time.perf_counter()
            fns[i]()
            elapsed[0] = time.perf_counter() - start
            comm.Allreduce(elapsed, slowest, op=MPI.MAX)
            best[i] = min(best[i], float(slowest[0]))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--reps", type=int, default=60)
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    backend = dist.current_backend()
    if backend.name != "mpi":
        raise SystemExit("run me under mpiexec: mpiexec -n 8 .venv/bin/python benchmarks/runtime_collectives.py")
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    rng = np.random.default_rng(me)  # every rank its own values
    dist.print_once(
        f"runtime_collectives: {n} ranks, float32, {MPI.Get_library_version().splitlines()[0].strip()}; "
        f"slowest rank, best of {args.reps}"
    )
    dist.print_once(
        f"{'size':>9}  {'transition':<14}{'reshard ms':>11}{'comm ms':>9}{'raw ms':>9}"
        f"{'reshard/raw':>13}{'comm/raw':>10}  raw op"
    )

    for mib in args.sizes_mib:
        for name, ours, ours_comm, raw, raw_name in cases(mib, mesh, rng):
            t_ours, t_comm, t_raw = timed(world, [ours, ours_comm, raw], args.reps)
            dist.print_once(
                f"{mib:>5} MiB  {name:<14}{t_ours * 1e3:>11.2f}{t_comm * 1e3:>9.2f}{t_raw * 1e3:>9.2f}"
                f"{t_ours / t_raw:>12.2f}x{t_comm / t_raw:>9.2f}x  {raw_name}"
            )


Case = tuple[str, Callable[[], object], Callable[[], object], Callable[[], object], str]


def natively(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` as it runs under ``MPIPAR_REDUCE=native`` (float sums by MPI's own reduction)."""
    comm = dist.current_backend().comm

    def run() -> object:
        saved, comm.native_sums = comm.native_sums, True
        try:
            return fn()
        finally:
            comm.native_sums = saved

    return run


def cases(mib: int, mesh: dist.ProcessMesh, rng: np.random.Generator) -> list[Case]:
    """(name, our reshard, our communicator call, raw mpi4py call, raw op) for one size."""
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    comm = dist.current_backend().comm
    group = tuple(range(n))
    side = int(np.sqrt(mib * 2**20 // 4))
    side -= side % n
    shape = (side, side)
    rows = side // n
    t_shard = dist.dtensor_from_local(
        rng.standard_normal((rows, side), dtype=np.float32), mesh, [dist.Shard(0)], shape=shape
    )
    t_partial = dist.dtensor_from_local(
        rng.standard_normal(shape, dtype=np.float32), mesh, [dist.Partial("sum")], shape=shape
    )
    # Every contender reads the tensors' own local shards (dtensor_from_local copied the
    # arrays): with separate copies, the reshard alone would read a buffer the other two never
    # touch, cold in cache where theirs is warm.
    sharded = t_shard.local_tensor()  # (side/n, side)
    partial = t_partial.local_tensor()  # (side, side)
    full = np.empty(shape, dtype=np.float32)
    block = np.empty((rows, side), dtype=np.float32)
    columns = np.empty((side, rows), dtype=np.float32)
    # The column blocks of the S(0) shard, described in place (the mpi4py idiom for "same buffers").
    column_block = MPI.FLOAT.Create_vector(rows, rows, side).Create_resized(0, rows * 4).Commit()
    row_blocks = [partial[i * rows : (i + 1) * rows] for i in range(n)]
    col_blocks = [sharded[:, j * rows : (j + 1) * rows] for j in range(n)]
    return [
        (
            "S(0)->R",
            lambda: dist.reshard(t_shard, mesh, [dist.Replicate()]),
            lambda: comm.all_gather(group, {me: sharded}, [(rows, side)] * n),
            lambda: world.Allgather(sharded, full),
            "Allgather",
        ),
        (
            "P->R",
            lambda: dist.reshard(t_partial, mesh, [dist.Replicate()]),
            lambda: comm.all_reduce(group, {me: partial}, "sum"),
            lambda: world.Allreduce(partial, full, op=MPI.SUM),
            "Allreduce",
        ),
        (
            "P->S(0)",
            lambda: dist.reshard(t_partial, mesh, [dist.Shard(0)]),
            lambda: comm.reduce_scatter(group, {me: row_blocks}, "sum"),
            lambda: world.Reduce_scatter_block(partial, block, op=MPI.SUM),
            "Reduce_scatter_block",
        ),
        (
            "P->R native",
            natively(lambda: dist.reshard(t_partial, mesh, [dist.Replicate()])),
            natively(lambda: comm.all_reduce(group, {me: partial}, "sum")),
            lambda: world.Allreduce(partial, full, op=MPI.SUM),
            "Allreduce",
        ),
        (
            "P->S(0) nat.",
            natively(lambda: dist.reshard(t_partial, mesh, [dist.Shard(0)])),
            natively(lambda: comm.reduce_scatter(group, {me: row_blocks}, "sum")),
            lambda: world.Reduce_scatter_block(partial, block, op=MPI.SUM),
            "Reduce_scatter_block",
        ),
        (
            "S(0)->S(1)",
            lambda: dist.reshard(t_shard, mesh, [dist.Shard(1)]),
            lambda: comm.all_to_all(group, {me: col_blocks}, {me: [(rows, rows)] * n}),
            lambda: world.Alltoall([sharded, 1, column_block], [columns, rows * rows, MPI.FLOAT]),
            "Alltoall (strided datatype)",
        ),
    ]


if __name__ == "__main__":
    main()
