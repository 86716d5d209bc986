"""Every Communicator method under MPI against the simulator's VirtualCommunicator, bit for bit.

    mpiexec -n 4 python tests/mpi_scripts/comm_cases.py --cases 120 --seed 0
    MPIPAR_BACKEND=nccl mpiexec -n 2 python tests/mpi_scripts/comm_cases.py   # one GPU per rank

Each rank builds every member's buffers from the same seed, runs the virtual communicator
on all of them in-process (the simulator's answer), runs the MPI communicator on its own
buffer, and compares its result byte for byte. Groups are random subsets of the world in
random order (ranks outside a group skip the call, as under a real plan); buffers are
small and large (9000-20000 elements), with NaN, -0.0 and uneven/empty pieces. All-reduces
and reduces take both of their paths: half the cases run with ``small_reduce_bytes`` at 0
(every one of more than n elements splits into reduce-scatter + all-gather), the others with
the default (buffers up to its size gathered whole, then folded). Half the cases run with the
MPI communicator's ``fold_min_bytes`` at 0, so every reduce-scatter, all-reduce and reduce
that splits takes the point-to-point path that folds each piece in as it arrives. Then point to point:
a ``send`` whose ``recv`` is posted only after a barrier (2 MiB, so MPI cannot buffer it
eagerly) must not deadlock, and a random batch of tagged transfers goes through ``exchange``.

With ``MPIPAR_REDUCE=native`` floating-point sums and averages come from MPI's own
reduction and are compared within the rounding any summation order allows; everything else
must still match bit for bit.

Rank 0 prints ``ok <n> cases`` at the end.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import mpipar as dist
from mpipar._xp import array_module, to_numpy
from mpipar.comm import PointToPoint
from mpipar.runtime.mpi import FOLD_AS_ARRIVING_MIN_BYTES
from mpipar.runtime.ordered import SMALL_REDUCE_BYTES
from simulator.virtual_comm import VirtualCommunicator

OPS = ["all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier"]


DEVICE: Any = np
"""The backend's array module: the NCCL backend is handed device arrays, as its shards are."""


def _on_host(x: Any) -> Any:
    """``x`` with every device array in it (dicts, lists, tuples) copied to a NumPy array."""
    if isinstance(x, dict):
        return {k: _on_host(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_on_host(v) for v in x)
    return to_numpy(x) if array_module(x) is not np else x  # a CuPy array (dtypes and scalars stay)


class HostOracle:
    """The simulator's communicator (the oracle) handed host copies of the arguments: it computes
    on NumPy, while the backend under test (NCCL) is handed the device arrays its shards are."""

    def __init__(self, virt: VirtualCommunicator) -> None:
        self._virt = virt

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._virt, name)
        return lambda *args, **kwargs: fn(*_on_host(args), **_on_host(kwargs))


def values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Random values; always an ndarray (NumPy returns scalars for shape ``()``; shards are arrays)."""
    return DEVICE.asarray(_host_values(rng, shape, dtype))


def _host_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind == "i":
        return np.asarray(rng.integers(-1000, 1000, size=shape).astype(dtype))
    a = np.asarray((rng.standard_normal(shape) * 10).astype(dtype))
    flat = a.reshape(-1)
    if flat.size > 4 and rng.random() < 0.3:
        flat[rng.integers(flat.size)] = np.nan
        flat[rng.integers(flat.size)] = -0.0
    return a


def same(label: str, got: Any, want: Any) -> None:
    got, want = to_numpy(got), to_numpy(want)  # CuPy results under the nccl backend
    if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
        raise AssertionError(
            f"{label}: MPI gives {got.dtype}{list(got.shape)}, the simulator {want.dtype}{list(want.shape)}"
            + (f"\nMPI {got.tolist()}\nsim {want.tolist()}" if got.size < 50 else "")
        )


def close(label: str, got: Any, want: Any, addends: list[np.ndarray], op: str) -> None:
    """``MPIPAR_REDUCE=native``: a float sum in MPI's own order, within the rounding any order
    allows (k addends: at most (k - 1) eps times the sum of their magnitudes), NaNs alike."""
    got, want = to_numpy(got), to_numpy(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(
            f"{label}: MPI gives {got.dtype}{list(got.shape)}, the simulator {want.dtype}{list(want.shape)}"
        )
    k = len(addends)
    bound = 2 * k * np.finfo(want.dtype).eps * sum(np.abs(a.astype(np.float64)) for a in addends)
    if op == "avg":
        bound = bound / k
    both_nan = np.isnan(got) & np.isnan(want)
    with np.errstate(invalid="ignore"):
        ok = both_nan | (got == want) | (np.abs(got.astype(np.float64) - want.astype(np.float64)) <= bound)
    if not np.all(ok):
        raise AssertionError(f"{label}: native sum off by more than rounding\nMPI {got.tolist()}\nsim {want.tolist()}")


def reduced(label: str, got: Any, want: Any, addends: list[np.ndarray], op: str, native: bool) -> None:
    """A reduction's result: within rounding where MPI summed natively, else bit for bit."""
    if native:
        close(label, got, want, addends, op)
    else:
        same(label, got, want)


def run_case(index: int, rng: np.random.Generator, world: int, me: int, mpi: Any) -> None:
    virt = HostOracle(VirtualCommunicator())
    k = int(rng.integers(1, world + 1))
    group = tuple(int(r) for r in rng.permutation(world)[:k])
    op = OPS[int(rng.integers(len(OPS)))]
    reduce_op = ["sum", "avg", "max", "min"][int(rng.integers(4))]
    dtype = np.dtype(["float64", "float32", "int64", "int32", "bool"][int(rng.integers(5))])
    if dtype == np.bool_ and op in ("all_reduce", "reduce", "reduce_scatter"):
        dtype = np.dtype("float64") if reduce_op in ("sum", "avg") else dtype
    big = rng.random() < 0.3
    shape = (
        (int(rng.integers(9000, 20000)),)
        if big
        else tuple(int(s) for s in rng.integers(0, 6, size=int(rng.integers(0, 3))))
    )
    fold_as_arriving = rng.random() < 0.5
    if hasattr(mpi, "fold_min_bytes"):  # the same draw on every rank: all members agree
        mpi.fold_min_bytes = 0 if fold_as_arriving else FOLD_AS_ARRIVING_MIN_BYTES
    split = rng.random() < 0.5
    mpi.small_reduce_bytes = 0 if split else SMALL_REDUCE_BYTES
    label = (
        f"case {index}: {op}({reduce_op}) {dtype}{list(shape)} on group {list(group)}"
        + (" (folded as arriving)" if fold_as_arriving else "")
        + (" (split)" if split else "")
    )
    mine = me in group

    if op in ("all_reduce", "reduce"):
        bufs = {r: values(rng, shape, dtype) for r in group}
        root = group[int(rng.integers(k))]
        if op == "all_reduce":
            want = virt.all_reduce(group, bufs, reduce_op)
            got = mpi.all_reduce(group, {me: bufs[me]}, reduce_op) if mine else {}
        else:
            want = virt.reduce(group, bufs, reduce_op, root)
            got = mpi.reduce(group, {me: bufs[me]}, reduce_op, root) if mine else {}
            if mine and set(got) != ({me} if me == root else set()):
                raise AssertionError(f"{label}: reduce returned results for {sorted(got)} on rank {me} (root {root})")
        if me in got:
            reduced(label, got[me], want[me], list(bufs.values()), reduce_op, _native(mpi, dtype, reduce_op, k))
    elif op == "reduce_scatter":
        pieces = [tuple(int(s) for s in rng.integers(0, 4, size=len(shape) or 1)) for _ in group]
        if big:
            pieces = [(int(rng.integers(2000, 5000)),) for _ in group]
        chunks = {r: [values(rng, p, dtype) for p in pieces] for r in group}
        want = virt.reduce_scatter(group, chunks, reduce_op)
        if mine:
            got_rs = mpi.reduce_scatter(group, {me: chunks[me]}, reduce_op)[me]
            addends = [chunks[r][group.index(me)] for r in group]
            reduced(label, got_rs, want[me], addends, reduce_op, _native(mpi, dtype, reduce_op, k))
    elif op == "all_gather":
        shapes = [tuple(int(s) for s in rng.integers(0, 5, size=2)) for _ in group]
        if rng.random() < 0.5:  # equal pieces: the plain (typed) all-gather, not the v-variant
            shapes = [shapes[0]] * k
        bufs = {r: values(rng, s, dtype) for r, s in zip(group, shapes, strict=True)}
        want = virt.all_gather(group, bufs, shapes)
        want_flat = virt.all_gather_flat(group, bufs, shapes)
        if mine:
            got = mpi.all_gather(group, {me: bufs[me]}, shapes)[me]
            for j, (g, w) in enumerate(zip(got, want[me], strict=True)):
                same(f"{label} piece {j}", g, w)
            joined = np.concatenate([to_numpy(w).reshape(-1) for w in want[me]])
            same(f"{label} flat (simulator)", want_flat[me], joined)
            same(f"{label} flat", mpi.all_gather_flat(group, {me: bufs[me]}, shapes)[me], joined)
    elif op == "all_to_all":
        sizes = rng.integers(0, 5, size=(k, k, 2))
        chunks = {
            r: [values(rng, tuple(int(x) for x in sizes[i, j]), dtype) for j in range(k)] for i, r in enumerate(group)
        }
        recv_shapes = {r: [tuple(int(x) for x in sizes[i, j]) for i in range(k)] for j, r in enumerate(group)}
        want = virt.all_to_all(group, chunks, recv_shapes)
        if mine:
            got = mpi.all_to_all(group, {me: chunks[me]}, recv_shapes)[me]
            for j, (g, w) in enumerate(zip(got, want[me], strict=True)):
                same(f"{label} from member {j}", g, w)
    elif op == "broadcast":
        root = group[int(rng.integers(k))]
        value = values(rng, shape, dtype)
        want = virt.broadcast(group, {r: (value if r == root else None) for r in group}, root, shape, dtype)
        if mine:
            same(label, mpi.broadcast(group, {me: value if me == root else None}, root, shape, dtype)[me], want[me])
    elif mine:
        mpi.barrier(group)


def _native(mpi: Any, dtype: np.dtype, reduce_op: str, k: int) -> bool:
    """Does this reduction go to MPI's own sum (``MPIPAR_REDUCE=native``)?"""
    return bool(getattr(mpi, "native_sums", False)) and dtype.kind in "fc" and reduce_op in ("sum", "avg") and k > 1


def point_to_point(rng: np.random.Generator, world: int, me: int, mpi: Any) -> None:
    everyone = tuple(range(world))
    # A send whose recv comes after a barrier: the send must be buffered, not block.
    nxt, prev = (me + 1) % world, (me - 1) % world
    payload = {r: np.full(1 << 18, float(r)) + np.arange(1 << 18) for r in range(world)}  # 2 MiB each
    mpi.send(me, nxt, payload[me], tag=3)
    mpi.barrier(everyone)
    same(
        "send before the matching recv",
        mpi.recv(prev, me, payload[prev].shape, payload[prev].dtype, tag=3),
        payload[prev],
    )
    # A batch of tagged transfers between random pairs, some empty, some to oneself.
    pairs = [(int(rng.integers(world)), int(rng.integers(world))) for _ in range(6 * world)]
    shapes = [tuple(int(s) for s in rng.integers(0, 40, size=2)) for _ in pairs]
    datas = [values(rng, s, np.dtype("float64")) for s in shapes]
    tags: dict[tuple[int, int], int] = {}
    transfers = []
    for (src, dst), shape, data in zip(pairs, shapes, datas, strict=True):
        tag = tags.get((src, dst), 0)
        tags[(src, dst)] = tag + 1
        if me in (src, dst):
            transfers.append(PointToPoint(src, dst, tag, shape, np.dtype("float64"), data if src == me else None))
    got = mpi.exchange(transfers, [me])
    for t in transfers:
        if t.dst == me:
            index = next(
                i
                for i, (p, _) in enumerate(zip(pairs, shapes, strict=True))
                if p == (t.src, t.dst) and sum(1 for q in pairs[:i] if q == (t.src, t.dst)) == t.tag
            )
            same(f"exchange {t.src} -> {t.dst} tag {t.tag}", got[(t.src, t.dst, t.tag)], datas[index])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    backend = dist.current_backend()
    assert backend.name in ("mpi", "nccl"), f"run me under mpiexec (backend is {backend.name})"
    world, me = backend.world_size, backend.rank
    global DEVICE
    DEVICE = backend.xp
    rng = np.random.default_rng([args.seed, world])
    for i in range(args.cases):
        run_case(i, rng, world, me, backend.comm)
    point_to_point(rng, world, me, backend.comm)
    dist.print_once(f"ok {args.cases} cases on {world} ranks")


if __name__ == "__main__":
    main()
