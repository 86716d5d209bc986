"""Results of the MPI communicator stay intact while referenced, though their buffers are reused.

    mpiexec -n 4 python tests/mpi_scripts/result_reuse.py --rounds 12

Round after round, every rank runs collectives and point-to-point transfers whose results
are the same byte size (1.5 MiB, above the result cache's threshold), with values that
depend on the round. It keeps the results of some rounds, in several forms that reference
the buffer (the array, a reshaped view, a slice, a memoryview), and drops the others, so
the cache hands dropped buffers out again while kept ones must never be touched. At the
end every kept result is compared, bit for bit, with the value the simulator's
communicator computes for that round. Rank 0 prints ``ok <rounds> rounds, <n> reuses``.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import mpipar as dist
from mpipar.comm import PointToPoint
from simulator.virtual_comm import VirtualCommunicator

ELEMS = 3 * 2**16  # 1.5 MiB of float64 per result


def member_values(round_: int, rank: int, count: int) -> np.ndarray:
    return np.random.default_rng([round_, rank]).standard_normal(count)


def run_round(round_: int, world: int, me: int, mpi: Any) -> dict[str, tuple[Any, np.ndarray]]:
    """(what was kept, the simulator's answer) per operation of this round."""
    group = tuple(range(world))
    virt = VirtualCommunicator()
    full = {r: member_values(round_, r, ELEMS) for r in group}
    pieces = {r: member_values(round_, r, ELEMS // world) for r in group}
    rows = {r: [member_values(round_, 100 * (j + 1) + r, ELEMS // world) for j in group] for r in group}
    want = {
        "all_reduce": virt.all_reduce(group, full, "sum")[me],
        "all_gather": np.concatenate(virt.all_gather(group, pieces, [p.shape for p in pieces.values()])[me]),
        "all_to_all": np.concatenate(virt.all_to_all(group, rows, {r: [c.shape for c in rows[r]] for r in group})[me]),
        "broadcast": full[round_ % world],
    }
    got: dict[str, Any] = {
        "all_reduce": mpi.all_reduce(group, {me: full[me]}, "sum")[me],
        "all_gather": mpi.all_gather(group, {me: pieces[me]}, [p.shape for p in pieces.values()])[me],
        "all_to_all": mpi.all_to_all(group, {me: rows[me]}, {me: [c.shape for c in rows[me]]})[me],
        "broadcast": mpi.broadcast(
            group, {me: full[me] if me == round_ % world else None}, round_ % world, (ELEMS,), np.float64
        )[me],
    }
    src, dst = (me - 1) % world, (me + 1) % world
    tag = 10 + round_
    received = mpi.exchange(
        [PointToPoint(me, dst, tag, (ELEMS,), np.float64, full[me]), PointToPoint(src, me, tag, (ELEMS,), np.float64)],
        [me],
    )
    got["exchange"] = received[(src, me, tag)]
    want["exchange"] = full[src]
    mpi.send(me, dst, full[me] * 2, tag=tag)
    got["recv"] = mpi.recv(src, me, (ELEMS,), np.float64, tag=tag)
    want["recv"] = full[src] * 2
    # Keep each result in a different form: every one of them must keep its buffer alive.
    forms = [
        lambda v: v,
        lambda v: v.reshape(-1)[1:],
        lambda v: memoryview(v.reshape(-1)[: ELEMS // 2]),
        lambda v: v.reshape(-1).reshape(2, -1),
    ]
    kept: dict[str, tuple[Any, Any]] = {}
    for i, (name, value) in enumerate(got.items()):
        expected = np.asarray(want[name])
        if isinstance(value, list):  # all_gather / all_to_all: pieces of one buffer; keep only the last
            value = value[-1]
            expected = expected[-value.size :]
        form = forms[(i + round_) % len(forms)]
        kept[name] = (form(value), form(expected.reshape(value.shape)))
    return kept


def check(label: str, kept: Any, want: Any) -> None:
    if np.asarray(kept).tobytes() != np.asarray(want).tobytes():
        raise AssertionError(f"{label}: a kept result changed after its buffer could have been reused")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    backend = dist.current_backend()
    mpi, me, world = backend.comm, backend.rank, backend.world_size
    kept: list[tuple[str, Any, Any]] = []
    for round_ in range(args.rounds):
        results = run_round(round_, world, me, mpi)
        if round_ % 3 != 1:  # drop every third round's results: their buffers go back to the cache
            kept.extend((f"round {round_} {name}", value, want) for name, (value, want) in results.items())
    for label, value, want in kept:
        check(label, value, want)
    reuses = mpi._results.reused
    if reuses == 0:
        raise AssertionError("the result cache was never used: this test checks nothing")
    dist.print_once(f"ok {args.rounds} rounds, {reuses} reuses")


if __name__ == "__main__":
    main()
