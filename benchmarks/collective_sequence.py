"""Does pricing each of a step's collectives at its own gap add up? A replay under ``mpiexec -n 8``.

    .venv/bin/python benchmarks/collective_sequence.py --profile profile.json [--mesh dp=8] [--op-us 240] [--passes 5]

``predict_vs_measure.py`` prices each of rank 0's reshard calls at the cost its worker measured
for an all-reduce after the same gap of NumPy work, in a steady loop (work, all-reduce, work,
all-reduce, ... every gap alike). A step is not such a loop: dp=8's 70 gradient all-reduces
follow a 50 ms stretch of forward and then come 0-2 ms apart through the backward. If the
ranks' drift built up over the long stretch and were paid once by the first call, or the
short gaps after it cost less than in a loop of short gaps, the per-call prices would not add
up to what the sequence costs.

This replays the sequence: the plan's gaps (``predict_vs_measure.collectives`` on ``gpt.py``'s
default model at this ``--mesh``, host seconds per op ``--op-us``) as NumPy work on all 8 ranks,
a 1 KiB all-reduce over the world after each, and the same work without the calls; the extra
time of the sequence (median over ``--passes``, every rank's median) against the sum of the
prices ``at_gap`` gives the same gaps from the steady loop's curve, measured in the same job
(interleaved with the sequence, pass after pass). Nothing of ``gpt.py``'s run is used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import predict_vs_measure as pvm  # noqa: E402  (a sibling script, not a package)
from results import add_json_argument, record  # noqa: E402  (a sibling script, not a package)


def sequence_gaps(profile_path: str, mesh: str, op_s: float) -> list[float]:
    """Rank 0's modelled seconds of work before each of its reshard calls in one step."""
    from simulator.cost import load_profile

    if not op_s >= 0 or op_s == float("inf"):
        raise ValueError(f"--op-us: host seconds per op must be finite and >= 0, got {op_s!r}")
    calls = pvm.collectives(pvm.gpt_step(mesh), load_profile(profile_path), {"op": op_s}, None)
    if not calls:
        raise ValueError(f"mesh {mesh!r}: rank 0 makes no collective call in gpt.py's step; nothing to replay")
    return [c.gap for c in calls]


def priced(curve: list[float], gaps: list[float]) -> float:
    """The sum of the steady loop's prices (``curve``: seconds per all-reduce over 8 ranks at each
    gap of ``predict_vs_measure.GAP_GRID``) over ``gaps``: what the benchmark charges the sequence."""
    if len(curve) != len(pvm.GAP_GRID):
        raise ValueError(f"curve has {len(curve)} points; GAP_GRID has {len(pvm.GAP_GRID)}")
    host = {f"allreduce8_{i}": c for i, c in enumerate(curve)}
    return sum(pvm.at_gap(host, 8, g) for g in gaps)


def worker(gaps: list[float], passes: int) -> None:
    """Each rank: the steady curve and the replayed sequence, interleaved pass after pass."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 8:
        raise SystemExit(f"collective_sequence: run under mpiexec -n 8, not {comm.Get_size()}")
    # The same unit of work and the same all-reduce as predict_vs_measure's worker.
    probe = pvm.GapProbe(comm)
    partial = probe.partial(list(range(8)))

    def sequence(with_collective: bool) -> float:
        comm.Barrier()
        start = time.perf_counter()
        for gap in gaps:
            probe.work(probe.units(gap))
            if with_collective:
                probe.all_reduce(partial)
        return time.perf_counter() - start

    probe.loop(partial, True, 3, 0)
    sequence(True)
    curve: list[list[float]] = [[] for _ in pvm.GAP_GRID]
    extra: list[float] = []
    for _ in range(passes):
        for g, gap in enumerate(pvm.GAP_GRID):
            curve[g].append(probe.paired(partial, gap))
        extra.append(sequence(True) - sequence(False))
    rows = comm.gather({"curve": [statistics.median(v) for v in curve], "extra": statistics.median(extra)}, root=0)
    if rank == 0:
        print(
            json.dumps(
                {
                    "curve": [statistics.median(r["curve"][i] for r in rows) for i in range(len(pvm.GAP_GRID))],
                    "extra": statistics.median(r["extra"] for r in rows),
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", required=True, help="a calibrated profile JSON (python -m simulator calibrate -n 8)"
    )
    parser.add_argument("--mesh", default="dp=8", help="gpt.py's --mesh whose rank-0 call sequence is replayed")
    parser.add_argument("--op-us", type=float, default=240.0, help="host microseconds per op (the worker's `op`)")
    parser.add_argument("--passes", type=int, default=5, help="interleaved passes (curve, sequence)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_json_argument(parser)
    ns = parser.parse_args()
    record(ns.json, __file__)
    if ns.passes < 1:
        parser.error(f"--passes must be >= 1, got {ns.passes}")
    if ns.worker:
        with open(ns.worker) as f:
            gaps = json.load(f)
        if not isinstance(gaps, list) or not all(isinstance(g, float | int) and 0 <= g < 10 for g in gaps):
            raise SystemExit(f"collective_sequence: {ns.worker}: expected a list of gaps in seconds (0 <= gap < 10)")
        worker([float(g) for g in gaps], ns.passes)
        return
    gaps = sequence_gaps(ns.profile, ns.mesh, ns.op_us * 1e-6)
    # A file of its own (not a fixed name in the checkout: two runs at once would share it).
    fd, path = tempfile.mkstemp(prefix="mpipar-collective-sequence-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(gaps, f)
    load = os.getloadavg()[0]
    try:
        result = pvm.worker_json(__file__, ["--profile", ns.profile, "--worker", path, "--passes", str(ns.passes)])
    finally:
        os.remove(path)
    cost = priced(result["curve"], gaps)
    curve = ", ".join(f"{g * 1e3:g} ms {c * 1e6:.0f} us" for g, c in zip(pvm.GAP_GRID, result["curve"], strict=True))
    print(
        f"{ns.mesh}: {len(gaps)} calls on rank 0 after {sum(gaps) * 1e3:.1f} ms of modelled work "
        f"(first gap {gaps[0] * 1e3:.1f} ms, op {ns.op_us:g} us); load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print(f"  steady all-reduce(8) after {curve}")
    print(
        f"  sequence: measured extra {result['extra'] * 1e3:.1f} ms, priced at each call's gap {cost * 1e3:.1f} ms, "
        f"priced/measured {cost / result['extra']:.2f}"
        if result["extra"] > 0
        else f"  sequence: measured extra {result['extra'] * 1e3:.1f} ms (no cost to compare), priced {cost * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
