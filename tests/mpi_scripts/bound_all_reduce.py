"""``MPICommunicator.bound_all_reduce`` (a captured program's all-reduce) against ``all_reduce``.

    mpiexec -n 4 python tests/mpi_scripts/bound_all_reduce.py

For each dtype, op, shape and group (the world, and the first two ranks), the bound call and
the general ``all_reduce`` reduce the same buffers: the results must be equal bit for bit,
also on a second call (the receive buffer is reused) and on a strided input; the bound call
must number its collectives on the group as the general one does (the sequence numbers that
check mode and the watchdog read). Where the general path does something else (the split
reduce-scatter + all-gather, the point-to-point gather, native sums) there is no bound call.
The general path is taken with the eager binding off (``bind_eager_all_reduces``); with it on
(the default), ``all_reduce`` itself must give the same bits through its kept bound call, and
keep one per signature. Each rank prints ``ok bound <cases>``.
"""

from __future__ import annotations

import numpy as np

import mpipar as dist
from mpipar.runtime import mpi


def main() -> None:
    backend = dist.current_backend()
    if backend.name != "mpi":
        raise SystemExit("run me under mpiexec")
    comm = backend.comm
    me, n = comm.rank, backend.world_size
    rng = np.random.default_rng(100 + me)
    cases = 0
    for group in (tuple(range(n)), (0, 1)):
        if me not in group:
            continue
        for dtype in (np.float32, np.float64, np.int32):
            for op in ("sum", "avg", "max", "min"):
                for shape in ((7,), (32, 24), (3, 5, 4)):
                    bound = comm.bound_all_reduce(group, shape, dtype, op)
                    assert bound is not None, (group, dtype, op, shape)
                    for _ in range(2):
                        a = (rng.standard_normal(shape) * 100).astype(dtype)
                        want = general(comm, group, a, op)
                        seq = comm._seq[group]
                        got = bound(a)
                        assert comm._seq[group] == seq + 1
                        assert got.shape == want.shape and got.dtype == want.dtype
                        assert got.tobytes() == want.tobytes(), (group, dtype, op, shape)
                        seq = comm._seq[group]
                        eager = comm.all_reduce(group, {me: a}, op)[me]  # the kept bound call
                        assert comm._seq[group] == seq + 1
                        assert eager.tobytes() == want.tobytes(), (group, dtype, op, shape)
                        assert eager is not got  # a fresh result: the kept buffers are not handed out
                    wide = (rng.standard_normal((shape[0], 2 * int(np.prod(shape[1:])))) * 100).astype(dtype)
                    strided = wide[:, ::2].reshape(shape)  # not contiguous: copied before the gather
                    want = general(comm, group, strided, op)
                    assert bound(strided).tobytes() == want.tobytes()
                    assert comm.all_reduce(group, {me: strided}, op)[me].tobytes() == want.tobytes()
                    cases += 1
        big = (mpi.GATHER_P2P_MIN_BYTES // (4 * len(group)) + 1,)
        assert comm.bound_all_reduce(group, big, np.float32, "sum") is None  # the point-to-point gather (or the split)
    comm.native_sums = True
    assert comm.bound_all_reduce(tuple(range(n)), (8,), np.float32, "sum") is None
    comm.native_sums = False
    # every case above is one the bound path covers: the first signatures are kept, up to the cap
    assert len(comm._eager_bound) == min(cases, mpi.EAGER_BOUND_MAX), len(comm._eager_bound)
    assert all(b is not None for b in comm._eager_bound.values())
    print(f"ok bound {cases}", flush=True)


def general(comm: mpi.MPICommunicator, group: tuple[int, ...], a: np.ndarray, op: str) -> np.ndarray:
    """``all_reduce`` by the general path (the eager binding off for the call)."""
    comm.bind_eager_all_reduces = False
    try:
        return comm.all_reduce(group, {comm.rank: a}, op)[comm.rank]
    finally:
        comm.bind_eager_all_reduces = True


if __name__ == "__main__":
    main()
