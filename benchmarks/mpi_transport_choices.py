"""The MPI communicator's transport choices, each against its alternative, same run.

    mpiexec -n 8 .venv/bin/python benchmarks/mpi_transport_choices.py [--sizes-kib 32 256 512 1024 4096] [--reps 60]
    mpiexec -n 4 .venv/bin/python benchmarks/mpi_transport_choices.py --all-reduce-kib 8 16 32 64 128 256 512 1024

For float32 buffers of each size (what each member sends), on a group of every rank, times

* **fold / all-to-all**: our ordered reduce-scatter folding each piece in as it arrives
  (``MPICommunicator._scatter_reduce``, point to point) against the same call moving every
  piece first with one all-to-all and reducing afterwards (``fold_min_bytes`` raised past
  the size). ``FOLD_AS_ARRIVING_MIN_BYTES`` sits where this ratio crosses 1 on this project's
  machine; rerun here to place it elsewhere.
* **blocking / non-blocking**: ``Allgather`` and ``Alltoall`` against ``Iallgather().Wait()``
  and ``Ialltoall().Wait()`` on the same buffers (the communicator uses the blocking calls).

With ``--all-reduce-kib`` (the sizes of each member's buffer), times instead the ordered
all-reduce's two paths against MPI's own ``Allreduce`` (MPI's summation order, not ours):

* **whole**: one all-gather of every member's whole buffer, then the local fold in group
  order (``small_reduce_bytes`` raised past the size);
* **rs+ag**: the reduce-scatter of ranges, each member folding its range, then the all-gather
  of the reduced ranges (``small_reduce_bytes`` 0);

and prints each against ``Allreduce`` and whole / rs+ag: ``gathers_whole``'s threshold
belongs where that last ratio crosses 1.

Each time is the slowest rank's, best of ``--reps``, the contenders of one size taking turns
in a fresh random order each round (the same on every rank). Prints the ratios: below 1
means the choice the communicator makes is the faster one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from mpi4py import MPI
from results import add_json_argument, record
from runtime_collectives import timed  # this script's directory: the same fair turns

import mpipar as dist
from mpipar.runtime.mpi import MPICommunicator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[32, 256, 512, 1024, 4096])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument(
        "--all-reduce-kib",
        type=int,
        nargs="+",
        default=None,
        help="time the all-reduce's paths for these buffer sizes (KiB per member) instead",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    backend = dist.current_backend()
    if backend.name != "mpi":
        raise SystemExit("run me under mpiexec: mpiexec -n 8 .venv/bin/python benchmarks/mpi_transport_choices.py")
    comm = backend.comm
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    group = tuple(range(n))
    sub = comm._rt.comm_for(group)  # the group's own communicator, as the collectives use it
    default_fold = comm.fold_min_bytes
    rng = np.random.default_rng(me)
    dist.print_once(f"mpi_transport_choices: {n} ranks, float32, slowest rank, best of {args.reps}")
    if args.all_reduce_kib:
        all_reduce_paths(comm, sub, args.all_reduce_kib, args.reps, rng)
        return
    dist.print_once(f"fold threshold now {default_fold // 1024} KiB")
    dist.print_once(
        f"{'size':>9}  {'fold ms':>8}{'a2a ms':>8}{'fold/a2a':>10}  {'allgather':>10}{'alltoall':>10}  (blocking / non-blocking)"
    )
    for kib in args.sizes_kib:
        count = kib * 1024 // 4
        count -= count % n
        calls = contenders(comm, sub, rng.standard_normal(count, dtype=np.float32))
        best = dict(zip(calls, timed(world, list(calls.values()), args.reps), strict=True))
        comm.fold_min_bytes = default_fold
        dist.print_once(
            f"{kib:>5} KiB  {best['fold'] * 1e3:>8.3f}{best['a2a'] * 1e3:>8.3f}{best['fold'] / best['a2a']:>9.2f}x"
            f"  {best['allgather'] / best['iallgather']:>9.2f}x{best['alltoall'] / best['ialltoall']:>9.2f}x"
        )


def all_reduce_paths(
    comm: MPICommunicator, sub: MPI.Comm, sizes_kib: list[int], reps: int, rng: np.random.Generator
) -> None:
    """The ordered all-reduce's two paths and MPI's ``Allreduce``, per buffer size."""
    world = MPI.COMM_WORLD
    n = sub.Get_size()
    default_small = comm.small_reduce_bytes
    dist.print_once(
        f"all-reduce paths, {n} ranks: whole = all-gather whole buffers + ordered fold, rs+ag = reduce-scatter + "
        f"all-gather; threshold now n x size <= {default_small // 1024} KiB gathers whole"
    )
    dist.print_once(
        f"{'size':>9}{'n x size':>10}  {'whole ms':>9}{'rs+ag ms':>9}{'MPI ms':>8}  {'whole/rs+ag':>12}{'best/MPI':>9}"
    )
    for kib in sizes_kib:
        calls = all_reduce_calls(comm, sub, rng.standard_normal(kib * 1024 // 4, dtype=np.float32))
        best = dict(zip(calls, timed(world, list(calls.values()), reps), strict=True))
        comm.small_reduce_bytes = default_small
        dist.print_once(
            f"{kib:>5} KiB{n * kib:>6} KiB  {best['whole'] * 1e3:>9.3f}{best['rs+ag'] * 1e3:>9.3f}{best['MPI'] * 1e3:>8.3f}"
            f"  {best['whole'] / best['rs+ag']:>11.2f}x{min(best['whole'], best['rs+ag']) / best['MPI']:>8.2f}x"
        )


def all_reduce_calls(comm: MPICommunicator, sub: MPI.Comm, send: np.ndarray) -> dict[str, Callable[[], object]]:
    """The ordered all-reduce of ``send`` by either path, and MPI's ``Allreduce`` of it."""
    group = tuple(range(sub.Get_size()))
    out = np.empty_like(send)

    def ordered(threshold: int) -> Callable[[], object]:
        def run() -> object:
            comm.small_reduce_bytes = threshold
            return comm.all_reduce(group, {comm.rank: send}, "sum")

        return run

    return {
        "whole": ordered(1 << 62),
        "rs+ag": ordered(0),
        "MPI": lambda: sub.Allreduce([send, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM),
    }


def contenders(comm: MPICommunicator, sub: MPI.Comm, send: np.ndarray) -> dict[str, Callable[[], object]]:
    """The calls to time on this rank's ``send`` (its pieces for each member, back to back)."""
    group = tuple(range(sub.Get_size()))
    me = MPI.COMM_WORLD.Get_rank()
    piece = send.size // len(group)
    chunks = {me: [send[j * piece : (j + 1) * piece] for j in range(len(group))]}
    gathered = np.empty(send.size * len(group), dtype=np.float32)
    exchanged = np.empty(send.size, dtype=np.float32)

    def reduce_scatter(threshold: int) -> Callable[[], object]:
        def run() -> object:
            comm.fold_min_bytes = threshold
            return comm.reduce_scatter(group, chunks, "sum")

        return run

    return {
        "fold": reduce_scatter(0),
        "a2a": reduce_scatter(1 << 62),
        "allgather": lambda: sub.Allgather([send, MPI.FLOAT], [gathered, MPI.FLOAT]),
        "iallgather": lambda: sub.Iallgather([send, MPI.FLOAT], [gathered, MPI.FLOAT]).Wait(),
        "alltoall": lambda: sub.Alltoall([send, MPI.FLOAT], [exchanged, MPI.FLOAT]),
        "ialltoall": lambda: sub.Ialltoall([send, MPI.FLOAT], [exchanged, MPI.FLOAT]).Wait(),
    }


if __name__ == "__main__":
    main()
