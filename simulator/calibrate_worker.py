"""MPI worker of ``python -m simulator calibrate``: raw timings, printed as JSON by rank 0.

Launched as ``mpiexec -n 2 python simulator/calibrate_worker.py '{"sizes": [...], ...}'`` with
one BLAS thread per rank (the launcher sets the environment before NumPy loads). Measures, with
plain mpi4py and no mpipar code in the loop:

* ping-pong between ranks 0 and 1 (one-way time = round trip / 2) at each message size;
* ``Allreduce`` (sum, float64) over all ranks at each size;
* NumPy GEMM (float64 and float32) on every rank at once, the contention ranks see in training;
* with ``"kernels": true``, ``simulator.calibrate_host``'s GEMM and elementwise rates by size and
  mpipar's host costs per op, reshard call and update (these do run mpipar code).

Each measurement repeats until ``budget_s`` passes (at least ``min_reps``) and keeps the best of
three batches, so a noisy neighbour on a shared machine inflates it as little as possible.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from simulator import calibrate_host


def _timed_batches(comm: Any, body: Callable[[], None], budget_s: float, min_reps: int) -> float:
    """Seconds per call of ``body`` (best of three batches); every rank runs the same count."""
    comm.Barrier()
    start = MPI.Wtime()
    body()
    body()
    probe = (MPI.Wtime() - start) / 2
    reps = max(min_reps, int(budget_s / 3 / max(probe, 1e-7)))
    reps = int(comm.bcast(min(reps, 20000), root=0))
    best = float("inf")
    for _ in range(3):
        comm.Barrier()
        start = MPI.Wtime()
        for _ in range(reps):
            body()
        elapsed = comm.allreduce(MPI.Wtime() - start, op=MPI.MAX)
        best = min(best, elapsed / reps)
    return best


def main(config: dict[str, Any]) -> dict[str, Any]:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [int(s) for s in config["sizes"]]
    budget = float(config["budget_s"])
    out: dict[str, Any] = {
        "ranks": size,
        "pingpong": {"bytes": [], "seconds": []},
        "allreduce": {"bytes": [], "seconds": []},
        "gemm": {},
    }

    for nbytes in sizes:
        buf = np.zeros(max(nbytes, 1), dtype=np.uint8)

        def pingpong(buf: np.ndarray = buf) -> None:
            if rank == 0:
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
            elif rank == 1:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)

        round_trip = _timed_batches(comm, pingpong, budget, 5)
        out["pingpong"]["bytes"].append(nbytes)
        out["pingpong"]["seconds"].append(round_trip / 2)

        count = max(nbytes // 8, 1)
        src = np.ones(count, dtype=np.float64)
        dst = np.empty_like(src)

        def allreduce(src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            comm.Allreduce(src, dst, op=MPI.SUM)

        out["allreduce"]["bytes"].append(count * 8)
        out["allreduce"]["seconds"].append(_timed_batches(comm, allreduce, budget, 5))

    n = int(config["gemm_n"])
    rng = np.random.default_rng(rank)
    for dtype in ("float64", "float32"):
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)

        def gemm(a: np.ndarray = a, b: np.ndarray = b) -> None:
            np.matmul(a, b)

        seconds = _timed_batches(comm, gemm, 2 * budget, 2)
        out["gemm"][dtype] = {"n": n, "seconds": seconds, "flops_per_s": 2.0 * n**3 / seconds}
    if config.get("kernels"):
        # The size-dependent kernel rates and mpipar's host costs (``simulator.calibrate_host``).
        def timed(body: Callable[[], None], budget_s: float) -> float:
            return _timed_batches(comm, body, budget_s, 2)

        out["gemm_curve"] = calibrate_host.gemm_points(timed, budget / 2)
        out["vector_curve"] = calibrate_host.vector_points(timed, budget / 2)
        host = comm.gather(calibrate_host.host_costs(comm, int(config.get("host_steps", 20))), root=0)
        probe = comm.gather(calibrate_host.kernel_probe(comm), root=0)
        if host is not None and probe is not None:  # rank 0: gather returns None elsewhere
            out["host"] = {k: sorted(h[k] for h in host)[len(host) // 2] for k in host[0]}
            # JSON keys are strings: the micro-batch of each probe run.
            out["kernel_probe"] = {str(b): sorted(p[b] for p in probe)[len(probe) // 2] for b in probe[0]}
    out["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps(result))
