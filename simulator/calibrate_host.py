"""What ``python -m simulator calibrate`` measures beyond links and one GEMM: this CPU's kernel
rates as functions of kernel size, and mpipar's host cost per op, reshard call and update.

Runs inside ``simulator/calibrate_worker.py`` (under ``mpiexec -n N``, one BLAS thread per rank,
every rank measuring at once: the contention training sees). ``benchmarks/predict_vs_measure.py``
reuses ``host_costs`` in its own worker.

* ``gemm_points``: float32 GEMMs of four shape families over four orders of magnitude of FLOPs:
  square ``n x n``, a batch of activations times one weight ``(b, 64, 256) @ (256, 256)``, a
  batch of per-sequence products ``(b, 256, 64) @ (b, 64, 256)`` (a weight gradient before its
  sum) and small attention-like ``(b, 64, 32) @ (b, 32, 64)``; FLOP/s of each, NumPy's fixed
  cost per call (a 2x2 product) taken out: ``op_overhead_s`` holds it.
* ``vector_points``: the elementwise chain ``tanh(exp(x * x + x))`` (four NumPy passes, four
  FLOPs per element as ``simulator.op_cost`` counts them) over arrays of 4 KiB to 4 MiB; FLOP/s
  against the bytes one pass reads and writes (2.25 arrays on average). A CPU runs small arrays
  from cache and large ones from memory, so the rate falls with size (the chain's fixed cost on a
  4-element array taken out, as for GEMMs).
* ``host_costs``: seconds per mpipar op and per parameter update (a tiny GPT step, compute
  negligible, on each rank's one-rank mesh, divided by the ops and updates a trace of it
  counts), per optimizer-phase op (the global-norm clip's squares, sums and scales: the
  clipped update's time over the plain one's, per op the clipped trace counts; they run
  outside autograd and record no tape), per gradient all-reduce of a data-parallel backward
  (``grad_sync_cost``: a dp=2 step over the one-rank one, per gradient reshard) and per reshard
  call beyond its MPI collective (an mpipar
  1 KiB all-reduce over pairs of ranks against a raw ``Allreduce`` of the same buffer on the
  same pairs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpipar as dist
from mpipar.compile.trace import trace
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from simulator.backend import SimBackend

VECTOR_ELEMENTS = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)
VECTOR_PASS_ARRAYS = 2.25
"""Arrays one pass of the chain reads and writes, on average: x*x (x, out), +x (two in, out), exp, tanh (in, out)."""


def gemm_shapes() -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(family, a's shape, b's shape) of every GEMM ``gemm_points`` times."""
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    shapes += [("square", (n, n), (n, n)) for n in (32, 64, 128, 256, 512)]
    shapes += [("batch x weight", (b, 64, 256), (256, 256)) for b in (1, 4, 16)]
    shapes += [("per-sequence", (b, 256, 64), (b, 64, 256)) for b in (1, 4, 16)]
    shapes += [("attention", (b, 64, 32), (b, 32, 64)) for b in (4, 16, 64)]
    return shapes


def gemm_flops(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """2 m n k per product, times the batch."""
    batch = int(np.prod(a[:-2])) if len(a) > 2 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def gemm_points(timed: Callable[[Callable[[], None], float], float], budget_s: float) -> list[dict[str, Any]]:
    """Each shape of ``gemm_shapes``: family, shapes, FLOPs, seconds and FLOP/s (float32).

    ``timed(body, budget)`` is the worker's timer (seconds per call, every rank at once)."""
    rng = np.random.default_rng(0)
    tiny_a, tiny_b = np.ones((2, 2), dtype=np.float32), np.ones((2, 2), dtype=np.float32)

    def call() -> None:
        np.matmul(tiny_a, tiny_b)

    fixed = timed(call, budget_s / 4)
    out = []
    for family, sa, sb in gemm_shapes():
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb).astype(np.float32)

        def body(a: np.ndarray = a, b: np.ndarray = b) -> None:
            np.matmul(a, b)

        seconds = timed(body, budget_s)
        flops = gemm_flops(sa, sb)
        work = kernel_seconds(seconds, fixed)
        out.append(
            {
                "family": family,
                "a": list(sa),
                "b": list(sb),
                "flops": flops,
                "seconds": seconds,
                "call_seconds": fixed,
                "flops_per_s": flops / work,
            }
        )
    return out


def vector_points(timed: Callable[[Callable[[], None], float], float], budget_s: float) -> list[dict[str, float]]:
    """Each size of ``VECTOR_ELEMENTS``: elements, bytes per pass, seconds and FLOP/s of the chain."""
    tiny = np.full(4, 0.5, dtype=np.float32)

    def calls() -> None:
        np.tanh(np.exp(tiny * tiny + tiny))

    fixed = timed(calls, budget_s / 4)
    out = []
    for n in VECTOR_ELEMENTS:
        x = np.full(n, 0.5, dtype=np.float32)

        def body(x: np.ndarray = x) -> None:
            np.tanh(np.exp(x * x + x))

        seconds = timed(body, budget_s)
        out.append(
            {
                "elements": n,
                "bytes": VECTOR_PASS_ARRAYS * x.nbytes,
                "seconds": seconds,
                "call_seconds": fixed,
                "flops_per_s": 4.0 * n / kernel_seconds(seconds, fixed),
            }
        )
    return out


def kernel_seconds(seconds: float, call: float) -> float:
    """A kernel's own seconds: the measured call less NumPy's fixed cost per call (``call``, timed
    on operands of a few elements), which the profile's ``op_overhead_s`` already holds (it is
    measured on ops that small). At least a tenth of the call, so noise cannot drive it to 0."""
    return max(seconds - call, 0.1 * seconds)


def gemm_curve(points: list[dict[str, Any]]) -> tuple[float, list[tuple[float, float]]]:
    """(peak FLOP/s, curve): the measured GEMMs in factor-of-4 bins of FLOPs, each bin one point
    at its geometric-mean FLOPs with the median rate of its GEMMs (shapes of a size alike), as a
    share of the best bin's rate (the peak)."""
    if not points:
        raise ValueError("gemm_curve: no GEMM measurements")
    bins: dict[int, list[dict[str, Any]]] = {}
    for p in points:
        if not p["flops_per_s"] > 0:
            raise ValueError(f"gemm_curve: GEMM {p['a']} @ {p['b']} measured {p['flops_per_s']!r} FLOP/s")
        bins.setdefault(int(np.floor(np.log(p["flops"]) / np.log(4.0))), []).append(p)
    rows = []
    for key in sorted(bins):
        group = bins[key]
        rows.append(
            (
                float(np.exp(np.mean([np.log(p["flops"]) for p in group]))),
                statistics.median(p["flops_per_s"] for p in group),
            )
        )
    peak = max(rate for _, rate in rows)
    return peak, [(flops, rate / peak) for flops, rate in rows]


def vector_curve(points: list[dict[str, float]]) -> list[tuple[float, float]]:
    """(bytes per pass, FLOP/s) of each measured size."""
    return [(float(p["bytes"]), float(p["flops_per_s"])) for p in points]


def host_costs(comm: Any, steps: int) -> dict[str, float]:
    """This rank's host seconds per mpipar op (``op``), per parameter update (``update``) and per
    reshard call beyond its MPI collective (``reshard``); all ranks measure at once."""
    rank = comm.Get_rank()
    cfg = GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=2, n_embd=8, dropout=0.0, dtype="float32")

    def tiny(clip: bool) -> dict[str, float]:
        """Median seconds of forward+backward and of the update, and what a traced step holds."""
        mesh = dist.ProcessMesh([[rank]], dim_names=["dp", "tp"])
        dist.seed(0)
        par = GPTParallel([mesh])
        model = GPT(cfg, par)
        opt = dist.optimizer.AdamW(
            learning_rate=1e-3,
            parameters=model.parameters(),
            grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0) if clip else None,
        )
        idx = dist.shard_tensor(
            np.arange(4, dtype=np.int64).reshape(1, 4) % 16, mesh, par.activation(mesh, seq_split=False)
        )

        def step() -> tuple[float, float]:
            start = time.perf_counter()
            loss = model.loss(idx, idx)
            loss.backward()
            mid = time.perf_counter()
            opt.step()
            opt.clear_grad()
            return mid - start, time.perf_counter() - mid

        for _ in range(3):
            step()
        with trace() as rec:
            step()
        plan = rec.plan()
        comm.Barrier()
        times = [step() for _ in range(steps)]
        # The update in one window of ``steps`` updates back to back: one update (well under a
        # millisecond here) is shorter than the scheduler's slice, so a rank sharing its core
        # either runs it whole or is preempted inside it, and the median of single updates came
        # out at full speed in most calibrations and 8-13x that in some. A window as long as
        # the forward+backward's pays the sharing at the rate the step does.
        model.loss(idx, idx).backward()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(steps):
            opt.step()
        window = (time.perf_counter() - start) / steps
        opt.clear_grad()
        return {
            "fb": statistics.median(t[0] for t in times),
            "update": window,
            "fb_ops": sum(1 for o in plan.ops if o.phase != "optimizer"),
            "opt_ops": sum(1 for o in plan.ops if o.phase == "optimizer"),
            "params": len(list(model.parameters())),
        }

    # Each rank runs its own one-rank GPT: in a world of its own, so that nothing it does is a
    # collective of the whole MPI world (the clip reads the norm with full_tensor, a world
    # collective under MPI that every process would have to make with the same root). The ops
    # take the same path as under MPI: one hosted rank per mesh.
    with dist.use_backend(SimBackend()):
        own = tiny(clip=True)
        alone = tiny(clip=False)
    # A reshard call: mpipar's all-reduce of a 1 KiB partial sum over pairs of ranks, less the raw
    # MPI Allreduce of the same buffer (the link time the collective formula already prices).
    size = comm.Get_size()
    pair = [rank // 2 * 2, rank // 2 * 2 + 1] if size % 2 == 0 else list(range(size))
    world = dist.ProcessMesh(pair, dim_names=["g"])
    group = comm.Split(pair[0], rank)
    partial = dist.dtensor_from_local(np.ones(256, dtype=np.float32), world, [dist.Partial()])
    src = np.ones(256, dtype=np.float32)
    dst = np.empty_like(src)

    def per_call(body: Callable[[], object], reps: int = 50) -> float:
        body()
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            body()
        return (time.perf_counter() - start) / reps

    from mpi4py import MPI

    sync = grad_sync_cost(comm, cfg, pair, max(9, steps))
    call = statistics.median(
        per_call(lambda: dist.reshard(partial, world, [dist.Replicate()]))
        - per_call(lambda: group.Allreduce(src, dst, op=MPI.SUM))
        for _ in range(3)
    )
    # The clip's ops (squares, sums, scales of every gradient) run outside autograd, with no tape
    # to record: their host cost is the clipped update's extra time over the plain one, per op.
    clip_op = (own["update"] - alone["update"]) / own["opt_ops"] if own["opt_ops"] else own["fb"] / own["fb_ops"]
    return {
        "op": own["fb"] / own["fb_ops"],
        "update": alone["update"] / alone["params"],
        "reshard": max(call, 0.0),
        "optimizer_op": max(clip_op, 0.0),
        "grad_sync": sync,
    }


def grad_sync_cost(comm: Any, cfg: GPTConfig, pair: list[int], steps: int) -> float:
    """Seconds one gradient all-reduce of a data-parallel backward costs, whole (host and link):
    the tiny GPT's forward+backward on a dp=2 mesh of this rank's pair (one sequence per rank,
    each parameter's gradient all-reduced as backward reaches it) less the same on the rank's
    own one-rank mesh (one sequence), over the gradient reshards a trace of the dp step counts.
    Both under MPI, every rank at once, in turns step by step: the estimate is the median of the
    paired differences, so a change of the machine's load falls on both of a pair (medians of two
    separate runs, differenced, came out anywhere from 0 to twice the cost here)."""
    rank = comm.Get_rank()
    runs: dict[str, Callable[[], float]] = {}
    calls = 0
    for name, ranks in (("own", [rank]), ("dp", pair)):
        mesh = dist.ProcessMesh([[r] for r in ranks], dim_names=["dp", "tp"])
        dist.seed(0)
        par = GPTParallel([mesh])
        model = GPT(cfg, par)
        idx = dist.shard_tensor(
            np.arange(4 * len(ranks), dtype=np.int64).reshape(len(ranks), 4) % cfg.vocab_size,
            mesh,
            par.activation(mesh, seq_split=False),
        )

        def step(model: GPT = model, idx: Any = idx) -> float:
            start = time.perf_counter()
            model.loss(idx, idx).backward()
            seconds = time.perf_counter() - start
            model.clear_gradients()
            return seconds

        for _ in range(3):
            step()
        if name == "dp":
            with trace() as rec:
                step()
            calls = sum(1 for r in rec.plan().reshards if r.op is None and r.reason.startswith("gradient of"))
        runs[name] = step
    comm.Barrier()
    gaps = [runs["dp"]() - runs["own"]() for _ in range(steps)]
    return max(statistics.median(gaps), 0.0) / max(calls, 1)


KERNEL_MODEL: dict[str, Any] = {
    "vocab_size": 128,
    "block_size": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "dropout": 0.0,
    "dtype": "float32",
}
"""gpt.py's default model: the kernel probe's (its layers' GEMMs and elementwise ops are a
training step's at the sizes ``--auto`` prices on this machine)."""
KERNEL_BATCHES = (2, 16)
"""Sequences per rank of the kernel probe's two runs: a data-parallel rank's and a whole stage's of gpt.py's batch 16."""


def kernel_probe(comm: Any, rounds: int = 2, steps: int = 3) -> dict[int, float]:
    """Median seconds of one forward+backward of ``KERNEL_MODEL`` on this rank's one-rank mesh at
    each of ``KERNEL_BATCHES`` sequences (every rank at once, the contention training sees), the
    least of ``rounds`` rounds taken in turn (a neighbour's burst spoils one, not both)."""
    rank = comm.Get_rank()
    mesh = dist.ProcessMesh([[rank]], dim_names=["dp", "tp"])
    par = GPTParallel([mesh])
    dist.seed(0)
    model = GPT(GPTConfig(**KERNEL_MODEL), par)
    seq, vocab = KERNEL_MODEL["block_size"], KERNEL_MODEL["vocab_size"]
    inputs = {
        b: dist.shard_tensor(
            np.arange(b * seq, dtype=np.int64).reshape(b, seq) % vocab, mesh, par.activation(mesh, seq_split=False)
        )
        for b in KERNEL_BATCHES
    }

    def once(b: int) -> float:
        start = time.perf_counter()
        model.loss(inputs[b], inputs[b]).backward()
        seconds = time.perf_counter() - start
        model.clear_gradients()
        return seconds

    best = {b: float("inf") for b in KERNEL_BATCHES}
    for b in KERNEL_BATCHES:
        once(b)
    for _ in range(rounds):
        for b in KERNEL_BATCHES:
            comm.Barrier()
            best[b] = min(best[b], statistics.median(once(b) for _ in range(steps)))
    return best


def kernel_scale(measured: dict[int, float], priced: dict[int, float]) -> float:
    """Measured kernel seconds per priced kernel second in ``KERNEL_MODEL``: the growth of its
    measured forward+backward from the small to the large probe batch over the growth of its
    priced kernel seconds. Both runs dispatch the same ops, so the host overhead cancels.

    The calibration's rates come from tight loops on hot operands; a training step's kernels run
    slower per FLOP (batched GEMMs of a layer's matrices, weight gradients as per-sequence
    products then a sum, several NumPy passes per elementwise op, operands other ops wrote).
    """
    small, large = KERNEL_BATCHES
    for name, values in (("measured", measured), ("priced", priced)):
        for b in KERNEL_BATCHES:
            v = values.get(b)
            if isinstance(v, bool) or not isinstance(v, float | int) or not v >= 0 or v == float("inf"):
                raise ValueError(
                    f"kernel probe: {name} seconds at micro-batch {b} is {v!r}; expected a finite number >= 0"
                )
    grew, priced_growth = measured[large] - measured[small], priced[large] - priced[small]
    if not priced_growth > 0:
        raise ValueError(
            f"kernel probe: priced kernel seconds do not grow from micro-batch {small} to {large} "
            f"({priced[small]!r} -> {priced[large]!r})"
        )
    if not grew > 0:
        raise ValueError(
            f"kernel probe: measured forward+backward did not grow from micro-batch {small} to {large} "
            f"({measured[small]:.4g} s -> {measured[large]:.4g} s): the machine's load changed during "
            "the probe; run again"
        )
    return grew / priced_growth
