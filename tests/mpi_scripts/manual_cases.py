"""Every manual collective against NumPy, on whatever world runs it.

    mpiexec -n 4 python tests/mpi_scripts/manual_cases.py
    python -m simulator -n 4 tests/mpi_scripts/manual_cases.py

Every rank can compute every rank's input (``value(rank, tag, ...)`` is deterministic), so
each rank checks its own results against NumPy. Inputs are small integers in every dtype, so
sums and products are exact and the results must be equal, not close. Shapes are uneven
(odd lengths, pieces of different sizes). Dtypes: float16/32/64, int32/64, complex128 (no
max/min for complex; avg only for floating and complex). Prints ``manual cases ok <n>`` per rank.
"""

from __future__ import annotations

import numpy as np

import mpipar as dist

DTYPES = ("bool", "int8", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64", "complex128")


def value(rank: int, tag: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, tag])
    real = rng.integers(-3, 4, shape)
    if np.dtype(dtype).kind == "c":
        return (real + 1j * rng.integers(-3, 4, shape)).astype(dtype)
    return real.astype(dtype)


def fold(arrays: list[np.ndarray], op: str) -> np.ndarray:
    if op == "avg":
        return (np.sum(arrays, axis=0) / len(arrays)).astype(arrays[0].dtype)
    f = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}[op]
    out = arrays[0]
    for a in arrays[1:]:
        out = f(out, a)
    return out


def same(got: object, want: np.ndarray, what: str) -> None:
    arr = got.numpy() if isinstance(got, dist.Tensor) else np.asarray(got)
    if arr.dtype != want.dtype or arr.shape != want.shape or not np.array_equal(arr, want):
        raise AssertionError(
            f"rank {dist.get_rank()}: {what}: got {arr.dtype}{arr.tolist()}, want {want.dtype}{want.tolist()}"
        )


def run_cases() -> int:
    me, n = dist.get_rank(), dist.get_world_size()
    world = list(range(n))
    checked = 0
    tag = 0
    for dtype in DTYPES:
        kind = np.dtype(dtype).kind
        ops = (["sum", "prod"] if kind == "c" else ["sum", "max", "min", "prod"]) + (["avg"] if kind in "fc" else [])
        for op in ops:
            tag += 1
            t = dist.to_tensor(value(me, tag, (7,), dtype))
            dist.all_reduce(t, op=op)
            same(t, fold([value(r, tag, (7,), dtype) for r in world], op), f"all_reduce({op}) {dtype}")
            checked += 1
        # a subgroup in reversed order: non-members are untouched
        tag += 1
        sub = dist.new_group(world[::-2])
        t = dist.to_tensor(value(me, tag, (3, 5), dtype))
        dist.all_reduce(t, group=sub)
        members = world[::-2]
        want = (
            fold([value(r, tag, (3, 5), dtype) for r in members], "sum")
            if me in members
            else value(me, tag, (3, 5), dtype)
        )
        same(t, want, f"all_reduce on {members} {dtype}")
        tag += 1
        t = dist.to_tensor(value(me, tag, (5,), dtype))
        dist.broadcast(t, src=n - 1)
        same(t, value(n - 1, tag, (5,), dtype), f"broadcast {dtype}")
        for op in ("sum", "prod"):
            tag += 1
            t = dist.to_tensor(value(me, tag, (2, 3), dtype))
            dist.reduce(t, dst=n // 2, op=op)
            want = (
                fold([value(r, tag, (2, 3), dtype) for r in world], op)
                if me == n // 2
                else value(me, tag, (2, 3), dtype)
            )
            same(t, want, f"reduce({op}) {dtype}")
        tag += 1
        got: list[dist.Tensor] = []
        dist.all_gather(got, dist.to_tensor(value(me, tag, (3,), dtype)))
        for r in world:
            same(got[r], value(r, tag, (3,), dtype), f"all_gather list {dtype}")
        into = dist.to_tensor(np.zeros((3 * n, 2), dtype))
        dist.all_gather(into, dist.to_tensor(value(me, tag, (3, 2), dtype)))
        same(into, np.concatenate([value(r, tag, (3, 2), dtype) for r in world]), f"all_gather tensor {dtype}")
        # reduce_scatter with pieces of different sizes: piece i is (i + 1, 2)
        tag += 1
        pieces = [value(me, tag * 100 + i, (i + 1, 2), dtype) for i in world]
        out = dist.to_tensor(np.zeros((me + 1, 2), dtype))
        dist.reduce_scatter(out, [dist.to_tensor(p) for p in pieces], op="sum")
        same(
            out,
            fold([value(r, tag * 100 + me, (me + 1, 2), dtype) for r in world], "sum"),
            f"reduce_scatter list {dtype}",
        )
        whole = np.concatenate([value(me, tag * 100 + i, (2,), dtype) for i in world])
        out = dist.to_tensor(np.zeros((2,), dtype))
        dist.reduce_scatter(out, dist.to_tensor(whole))
        same(out, fold([value(r, tag * 100 + me, (2,), dtype) for r in world], "sum"), f"reduce_scatter tensor {dtype}")
        # alltoall, uneven: rank r sends rank j a piece of length r + j + 1
        tag += 1
        outs = [dist.to_tensor(np.zeros((r + me + 1,), dtype)) for r in world]
        dist.alltoall([dist.to_tensor(value(me * n + j, tag, (me + j + 1,), dtype)) for j in world], outs)
        for r in world:
            same(outs[r], value(r * n + me, tag, (r + me + 1,), dtype), f"alltoall uneven {dtype}")
        empty: list[dist.Tensor] = []
        dist.alltoall([dist.to_tensor(value(me * n + j, tag + 1, (4,), dtype)) for j in world], empty)
        for r in world:
            same(empty[r], value(r * n + me, tag + 1, (4,), dtype), f"alltoall equal {dtype}")
        tag += 2
        t = dist.to_tensor(np.zeros((3,), dtype))
        dist.scatter(t, [dist.to_tensor(value(j, tag, (3,), dtype)) for j in world] if me == 0 else None, src=0)
        same(t, value(me, tag, (3,), dtype), f"scatter {dtype}")
        tag += 1
        gathered: list[dist.Tensor] = []
        dist.gather(dist.to_tensor(value(me, tag, (2, 2), dtype)), gathered, dst=n - 1)
        if me == n - 1:
            for r in world:
                same(gathered[r], value(r, tag, (2, 2), dtype), f"gather {dtype}")
        else:
            assert gathered == [], gathered
        if n > 1:  # a ring of messages, blocking and non-blocking
            tag += 1
            nxt, prv = (me + 1) % n, (me - 1) % n
            dist.send(dist.to_tensor(value(me, tag, (6,), dtype)), dst=nxt)
            got_msg = dist.to_tensor(np.zeros((6,), dtype))
            dist.recv(got_msg, src=prv)
            same(got_msg, value(prv, tag, (6,), dtype), f"send/recv {dtype}")
            buf = np.zeros((2, 3), dtype)  # a NumPy array works in place as well
            task = dist.irecv(buf, src=prv)
            dist.isend(value(me, tag + 1, (2, 3), dtype), dst=nxt).wait()
            task.wait()
            same(buf, value(prv, tag + 1, (2, 3), dtype), f"isend/irecv {dtype}")
            tag += 1
        checked += 13
    dist.barrier()
    return checked


if __name__ == "__main__":
    print(f"manual cases ok {run_cases()}", flush=True)
