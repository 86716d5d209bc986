"""The issue's TP MLP training step: mpipar vs the same math hand-written with mpi4py and NumPy.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \\
        .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/tp_mlp_vs_mpi4py.py [--iters 30] [--rounds 3]

The step: batch 32, 256 -> 4096 -> 256 (Linear with bias, ReLU, Linear with bias), float32,
loss ``mean(y * y)``, forward, backward and SGD, the hidden dim split over the ranks (Megatron:
first weight ``Shard(1)``, second ``Shard(0)``). The hand-written version is Megatron's MLP:
one all-reduce forward (the second matmul's partial sums), none backward. Four variants run
in turns in one launch, on the same ranks: the hand-written one, mpipar, mpipar replayed
(``dist.compile_step``: the first step's decisions handed back by position) and mpipar with
each reshard once turned off (``reuse_reshards(False)``: what the step did before). Before timing,
every variant's loss and updated weights are checked against the hand-written ones, and
mpipar's all-reduces per step are counted. A step is timed between barriers, the slowest rank
counts. Within a round the variants take turns step by step, in a fresh random order each
time (the same on every rank; ``steps_in_turns``), so a change in the machine's load while a
round runs falls on every variant alike instead of on whichever ran its steps then.

Reported per variant over every timed step of every round: p10, p50 and p90 of the step time
(the slowest rank's), p90 / p50 (the spread), and both as ratios to the hand-written step
(aims: p50 at most 1.2x, spread at most 1.2x); ``--per-rank`` adds each rank's own
distribution, ``--cpu`` each rank's CPU time per step (median), ``--print-json`` prints it all
as JSON instead, and ``--json PATH`` writes what is printed to a results record
(``benchmarks/results.py``). The load average is printed before and after, with the cores
rank 0 runs on (one where mpipar bound it: ``MPIPAR_BIND_CORES``) and the collector runs per
rank during timing. ``--gc disabled`` turns Python's garbage
collector off on every rank while timing; ``MPIPAR_REDUCE=native`` times MPI's own sums;
``MPIPAR_GC=off`` times without mpipar's collector policy (``docs/performance.md``).
"""

from __future__ import annotations  # noqa: I001  (mpipar before mpi4py: below)

import argparse
import gc
import json
import math
import os
import time
from collections.abc import Callable

import numpy as np

# mpipar first (as a user's script would have it): it sets how ranks wait inside MPI
# (mpipar.runtime.waits) before importing mpi4py starts MPI; the hand-written step gets it too.
import mpipar as dist
from mpi4py import MPI
from results import add_json_argument, record
from tp_mlp import sgd_step, sgd_step_tensor
from mpipar.runtime.ordered import reduce_mode_from_env
from mpipar.tensor import reuse_reshards

BATCH, IN, HIDDEN, LR = 32, 256, 4096, 0.01


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((BATCH, IN), dtype=np.float32),
        "w1": rng.standard_normal((IN, HIDDEN), dtype=np.float32) / np.float32(np.sqrt(IN)),
        "b1": rng.standard_normal(HIDDEN, dtype=np.float32) * np.float32(0.1),
        "w2": rng.standard_normal((HIDDEN, IN), dtype=np.float32) / np.float32(np.sqrt(HIDDEN)),
        "b2": rng.standard_normal(IN, dtype=np.float32) * np.float32(0.1),
    }


def hand_written(world: MPI.Comm) -> tuple[Callable[[], float], Callable[[], dict[str, np.ndarray]]]:
    """Megatron's MLP with mpi4py: the local shards, one Allreduce forward."""
    n, me = world.Get_size(), world.Get_rank()
    v = initial()
    cols = slice(me * HIDDEN // n, (me + 1) * HIDDEN // n)
    x = v["x"]
    w1, b1 = v["w1"][:, cols].copy(), v["b1"][cols].copy()
    w2, b2 = v["w2"][cols].copy(), v["b2"].copy()
    y = np.empty((BATCH, IN), np.float32)

    def step() -> float:
        h = np.maximum(x @ w1 + b1, 0)
        world.Allreduce(h @ w2, y)
        z = y + b2
        loss = float(np.mean(z * z))
        gz = z * np.float32(2 / z.size)
        gh = (gz @ w2.T) * (h > 0)
        w2[...] -= LR * (h.T @ gz)
        b2[...] -= LR * gz.sum(0)
        w1[...] -= LR * (x.T @ gh)
        b1[...] -= LR * gh.sum(0)
        return loss

    def state() -> dict[str, np.ndarray]:
        full_w1 = np.concatenate(world.allgather(w1), axis=1)
        return {"w1": full_w1, "w2": np.concatenate(world.allgather(w2), axis=0), "b2": b2}

    return step, state


def ours(world: MPI.Comm, captured: bool = False) -> tuple[Callable[[], float], Callable[[], dict[str, np.ndarray]]]:
    """mpipar's step; ``captured``: through ``compile_step(capture=True)``, the loss Tensor made a
    float by the caller (the same work: the hand-written step returns a float too)."""
    n = world.Get_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["mp"])
    v = initial()
    x = dist.shard_tensor(v["x"], mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(v["w1"]), mesh, [dist.Shard(1)])
    b1 = dist.shard_tensor(dist.Parameter(v["b1"]), mesh, [dist.Shard(0)])
    w2 = dist.shard_tensor(dist.Parameter(v["w2"]), mesh, [dist.Shard(0)])
    b2 = dist.shard_tensor(dist.Parameter(v["b2"]), mesh, [dist.Replicate()])
    opt = dist.optimizer.SGD(learning_rate=LR, parameters=[w1, b1, w2, b2])
    if captured:
        program = dist.compile_step(sgd_step_tensor(x, w1, b1, w2, b2, opt), capture=True)

        def step() -> float:
            return float(program())

        step.compiled = program  # type: ignore[attr-defined]
    else:
        step = sgd_step(x, w1, b1, w2, b2, opt)

    def state() -> dict[str, np.ndarray]:
        return {"w1": w1.full_tensor(), "w2": w2.full_tensor(), "b2": b2.full_tensor()}

    return step, state


def steps_in_turns(
    world: MPI.Comm,
    steps: dict[str, Callable[[], object]],
    iters: int,
    warmup: int = 3,
    cpu: dict[str, list[float]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each step's time over ``iters`` turns: the slowest rank's (between barriers), and this
    rank's own (from the barrier to its return, its waits for the others included). Every turn
    runs each step once, in an order drawn afresh (the same seed on every rank, so all ranks
    call alike), after ``warmup`` untimed turns. ``cpu``: also this rank's CPU time per step
    (``time.thread_time``: waiting for a core is not counted; polling inside MPI is)."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    order = np.random.default_rng(2026)
    slowest_times: dict[str, list[float]] = {name: [] for name in names}
    own_times: dict[str, list[float]] = {name: [] for name in names}
    elapsed, slowest = np.empty(1), np.empty(1)
    for _ in range(iters):
        for i in order.permutation(len(names)):
            world.Barrier()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            steps[names[i]]()
            elapsed[0] = time.perf_counter() - t0
            if cpu is not None:
                cpu[names[i]].append(time.thread_time() - c0)
            world.Allreduce(elapsed, slowest, op=MPI.MAX)
            slowest_times[names[i]].append(float(slowest[0]))
            own_times[names[i]].append(float(elapsed[0]))
    return slowest_times, own_times


class CollectorPauses:
    """A ``gc.callbacks`` entry: how often each generation was collected, and the longest pause."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.longest = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        gen = info["generation"]
        self.runs[gen] += 1
        self.longest[gen] = max(self.longest[gen], time.perf_counter() - self._start)


PERCENTILES = (10, 50, 90)


def spread(times: list[float]) -> dict[str, float]:
    """p10, p50 and p90 of these step times, in ms, and p90 / p50."""
    p10, p50, p90 = (float(v) * 1e3 for v in np.percentile(times, PERCENTILES))
    return {"p10": p10, "p50": p50, "p90": p90, "p90/p50": p90 / p50}


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # not every platform has one
        return (math.nan, math.nan, math.nan)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--hidden",
        type=int,
        default=4096,
        help="the hidden width (4096); with -n 1, 1024 gives one rank of -n 4 its shapes without the other three",
    )
    p.add_argument(
        "--gc",
        choices=["as-is", "disabled"],
        default="as-is",
        help="Python's garbage collector while timing: as mpipar leaves it (see MPIPAR_GC), or disabled on every rank",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="VARIANT",
        help="time this variant besides the hand-written one (repeatable; default: all), e.g. --only mpipar",
    )
    p.add_argument("--per-rank", action="store_true", help="also print each rank's own p10 / p50 / p90")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="also print each rank's CPU time per step (median; time.thread_time, so waiting for a core is not counted)",
    )
    p.add_argument("--print-json", action="store_true", help="print the results as one JSON object instead")
    add_json_argument(p)
    args = p.parse_args()
    record(args.json, __file__)
    global HIDDEN
    HIDDEN = args.hidden
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    if dist.current_backend().name != "mpi":
        raise SystemExit("run me under mpiexec with the MPI backend")

    # Correctness first: two steps of each agree with the hand-written ones.
    ref_step, ref_state = hand_written(world)
    ref_losses = [ref_step() for _ in range(2)]
    variants: dict[str, Callable[[], float]] = {"hand-written mpi4py": hand_written(world)[0]}
    wanted = {w.strip() for w in args.only}
    for label, reuse in (
        ("mpipar", True),
        ("mpipar, replayed", True),
        ("mpipar, reuse off", False),
        ("mpipar, captured", True),
    ):
        if wanted and label not in wanted:
            continue
        step, state = ours(world, captured=label == "mpipar, captured")
        if label == "mpipar, replayed":
            step = dist.compile_step(step)
        want_losses, want_state = ref_losses, ref_state
        if label == "mpipar, captured":
            # Two traced calls first (the second validates the program), against a fresh
            # hand-written run taking the same steps; then two captured steps are checked and counted.
            cap_step, want_state = hand_written(world)
            losses = [step() for _ in range(2)]
            np.testing.assert_allclose(losses, [cap_step() for _ in range(2)], rtol=1e-4)
            compiled = step.compiled  # type: ignore[attr-defined]
            if not compiled.captured:
                raise SystemExit(f"the step was not captured: {compiled.capture_refused}")
            want_losses = [cap_step() for _ in range(2)]
        with reuse_reshards(reuse), dist.CommDebugMode() as comm:
            losses = [step() for _ in range(2)]
        np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
        for k, want in want_state().items():
            np.testing.assert_allclose(state()[k], want, rtol=1e-3, atol=1e-5)
        if me == 0 and not args.print_json:
            print(
                f"{label}: {comm.counts().get('all_reduce', 0) // 2} all-reduce(s) per step, "
                f"{len(comm.reused) // 2} reshard(s) reused; step matches the hand-written one",
                flush=True,
            )

        def timed(step: Callable[[], float] = step, reuse: bool = reuse) -> float:
            with reuse_reshards(reuse):
                return step()

        # Reuse is on by default: only the variant that turns it off needs the context around
        # each step (a generator context manager, a few microseconds the others need not pay).
        variants[label] = step if reuse else timed

    if args.gc == "disabled":
        gc.disable()
    pauses = CollectorPauses()
    gc.callbacks.append(pauses)
    load_before = load_average()
    slowest: dict[str, list[float]] = {k: [] for k in variants}
    own: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        round_slowest, round_own = steps_in_turns(world, variants, args.iters, cpu=cpu)
        for label in variants:
            slowest[label] += round_slowest[label]
            own[label] += round_own[label]
    gc.callbacks.remove(pauses)
    collections = np.array([*pauses.runs, *pauses.longest], float)
    # Every rank's own step times and collector runs, to rank 0 (buffer calls of plain arrays).
    mine = np.array([own[label] for label in variants], dtype=np.float64)
    every_rank = np.empty((world.Get_size(), *mine.shape)) if me == 0 else None
    world.Gather(mine, every_rank, root=0)
    every_gc = np.empty((world.Get_size(), 6)) if me == 0 else None
    world.Gather(collections, every_gc, root=0)
    my_cpu = np.array([np.median(cpu[label]) for label in variants], dtype=np.float64)
    every_cpu = np.empty((world.Get_size(), len(variants))) if me == 0 else None
    world.Gather(my_cpu, every_cpu, root=0)
    if me != 0:
        return
    assert every_rank is not None and every_gc is not None and every_cpu is not None
    base = spread(slowest["hand-written mpi4py"])
    report: dict[str, object] = {
        "ranks": world.Get_size(),
        "reduce": reduce_mode_from_env(),
        "gc": args.gc,
        "heavy_yield": os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset"),
        "rank0_cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mpipar_gc": os.environ.get("MPIPAR_GC", ""),
        "steps_per_variant": args.rounds * args.iters,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "gc_runs_per_rank": every_gc[:, :3].astype(int).tolist(),
        "gc_longest_pause_ms_per_rank": (every_gc[:, 3:] * 1e3).round(3).tolist(),
        "variants": {},
    }
    for v, label in enumerate(variants):
        s = spread(slowest[label])
        s["p50 vs hand-written"] = s["p50"] / base["p50"]
        s["spread vs hand-written"] = s["p90/p50"] / base["p90/p50"]
        s["per_rank"] = [spread(list(every_rank[r, v])) for r in range(world.Get_size())]
        s["cpu_ms_per_rank"] = (every_cpu[:, v] * 1e3).round(3).tolist()
        report["variants"][label] = s  # type: ignore[index]
    if args.print_json:
        print(json.dumps(report, indent=1), flush=True)
        return
    print(
        f"{world.Get_size()} ranks, sums {report['reduce']}, MPICH heavy yield {report['heavy_yield']}, "
        f"rank 0 on cores {report['rank0_cores']} (MPIPAR_BIND_CORES={os.environ.get('MPIPAR_BIND_CORES', 'unset')}), collector {args.gc}"
        f" (MPIPAR_GC={report['mpipar_gc'] or 'unset'}), {report['steps_per_variant']} steps per variant, load average "
        f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in report['load_average_after'])} after",  # type: ignore[union-attr]
        flush=True,
    )
    print(
        f"collector runs per rank while timing (gen 0, 1, 2): {report['gc_runs_per_rank']}; "
        f"longest pause ms: {report['gc_longest_pause_ms_per_rank']}"
    )
    print(
        f"{'slowest rank, ms':22s} {'p10':>8s} {'p50':>8s} {'p90':>8s} {'p90/p50':>8s} {'p50 x':>6s} {'spread x':>8s}"
    )
    for label, s in report["variants"].items():  # type: ignore[attr-defined]
        print(
            f"{label:22s} {s['p10']:8.3f} {s['p50']:8.3f} {s['p90']:8.3f} {s['p90/p50']:8.2f} "
            f"{s['p50 vs hand-written']:5.2f}x {s['spread vs hand-written']:7.2f}x",
            flush=True,
        )
    if args.cpu:
        print("each rank's CPU per step, ms (median; waiting for a core not counted, polling in MPI counted)")
        hand_cpu = float(np.median(every_cpu[:, 0]))
        for label, s in report["variants"].items():  # type: ignore[attr-defined]
            ranks_cpu = s["cpu_ms_per_rank"]
            cells = "  ".join(f"r{r} {c:.2f}" for r, c in enumerate(ranks_cpu))
            print(f"{label:22s} {cells}  ({float(np.median(ranks_cpu)) / (hand_cpu * 1e3):.2f}x)", flush=True)
    if args.per_rank:
        print("each rank's own step (its waits for the others included), ms: p10 / p50 / p90")
        for label, s in report["variants"].items():  # type: ignore[attr-defined]
            cells = "  ".join(f"r{r} {q['p10']:.2f}/{q['p50']:.2f}/{q['p90']:.2f}" for r, q in enumerate(s["per_rank"]))
            print(f"{label:22s} {cells}", flush=True)


if __name__ == "__main__":
    main()
