"""Predicted vs measured step time of ``examples/gpt.py`` on ``mpiexec -n 8``, three strategies.

    .venv/bin/python benchmarks/predict_vs_measure.py [--profile profile.json] [--steps 10] [--rounds 3]
        [--strategies "dp=8;dp=2,tp=4;dp=1,tp=2,pp=4"] [--model flat|curves|sized]

1. **Calibrate** this machine as 8 ranks see it (every measurement runs on all 8 at once, the
   contention training sees): ``python -m simulator calibrate -n 8`` for the MPI links and the
   GEMM rate (or ``--profile`` to reuse one), then this script's ``--worker`` mode under
   ``mpiexec -n 8`` for what the profile does not hold: host seconds per mpipar op and per
   parameter update (each rank times a tiny GPT step -- 8-wide, 4 tokens, compute negligible --
   on its own one-rank mesh and divides by the ops and updates a trace of it counts); what a
   collective costs amid Python work (an all-reduce over 2, 4 and 8 ranks after 0, 0.3, 1, 3
   and 10 ms of NumPy work, the extra time per collective: ``call + 2 (n - 1) alpha``, with 1
   KiB, 64 KiB and 512 KiB on each rank: each call is priced at its own size, ``at_gap``);
   NumPy's elementwise FLOP rate and the 512x512 GEMM rate (calibrate's measurement, taken
   again: the prediction's GEMM rates are the profile's moved to it). Host costs move with
   the machine's load, so the worker runs once per round among the strategies' runs (below)
   and every constant is the median of its runs: one set prices all three strategies, and its
   spread (least .. largest) is printed. The collective's gaps are interleaved, pass after pass
   (``COLLECTIVE_PASSES``), each gap's cost the median of its passes. A collective's cost
   depends on the work before it: ranks time-sharing cores drift apart while they work and
   the collective waits for the last (here about 0.7 ms right after another collective, 3 ms
   after 1 ms of work), so each of the plan's collectives is priced at its own gap (rank 0's
   modelled work since its previous collective), interpolated between the measured gaps, and
   at its own group size (``loaded_latency``: an all-reduce over 4 costs more than the ring's
   line from 2 to 8 says, on ranks that time-share cores). And
   what kernels cost in a training step: gpt.py's model on each rank's one-rank mesh at
   micro-batch 2 and 16 (the per-rank batches of dp=8 and of a pipeline stage); the two runs
   dispatch the same ops, so the growth of their forward+backward over the growth of their
   priced kernel seconds (``kern x``) is measured kernel time per priced kernel second. The
   calibration's rates come from tight loops on hot operands (a 512x512 GEMM, an elementwise
   chain over 64 KiB); in the model the kernels run 2-3x slower per FLOP (``kern x`` 2.0-2.8
   here under load: batched GEMMs of a layer's matrices, weight gradients as per-sequence
   products summed after, several NumPy passes per elementwise op, operands that other ops
   wrote earlier). That is the flat model (``flat s``: one GEMM and one elementwise rate, every
   kernel divided by ``kern x``). The prediction uses the profile's size-dependent rates
   instead (``calibrate``'s ``gemm_curve`` and ``vector_curve``, moved to the load now by the
   worker's 512x512 GEMM and elementwise loop; ``curve s`` alone), and divides them by what
   the same probe still measures beyond them (``curve x``): small kernels keep the curves'
   lower cost per FLOP or byte, large ones their higher (``curve/x``). Both predictions are
   printed with their ratio to the measured step; ``--model`` picks the one the order check
   uses (default ``curves``: the size-dependent rates ``estimate`` itself prices kernels with).
   Two more terms are priced from a step probe, each from a probe that pays it as a step does
   (``step_scales``). The step probe is gpt.py's model cut to 2 layers with 1 sequence per rank
   (``PROBE_LAYERS``, ``PROBE_BATCH``), unlike every checked strategy (4 layers; dp=8 runs 2
   sequences per rank), so none of them has its optimizer phase or collectives measured: the
   probe has fewer gradients (fewer calls, a smaller update) and half dp=8's work between its
   calls. The optimizer phase (global-norm clipping and AdamW) is the strategy's priced
   optimizer phase times ``opt x``, the probe's timed clipped update over its price (the
   clipping's ops are host-bound and the update streams each array once, neither runs at the
   forward+backward's ``curve x``); the collectives are the steady loop's prices (their shape
   over gaps and group sizes) times ``comm x``, the probe run data parallel over all 8 ranks
   (``dp_fb``: each gradient all-reduced in the backward) less the same work on one-rank meshes
   (``probe_fb``), over the loop's prices of the probe's own calls (between a step's calls are
   mpipar ops, and the ranks drift apart far less than the loop's NumPy gaps say).
2. **Predict** each strategy with ``simulator.estimate`` (shape-only trace of gpt.py's default
   model: 4 layers, hidden 128, 4 heads, seq 64, vocab 128, global batch 16, float32, AdamW with
   global-norm clipping; one micro-batch, so a pipeline runs its stages one after another as
   gpt.py does) on that profile, bandwidth and overheads. Nothing is fitted to the runs below.
3. **Measure** ``gpt.py --mesh ... --steps N`` under ``mpiexec -n 8``: seconds per step = median
   gap between consecutive ``step <n> loss`` lines, the first step excluded. ``--rounds``
   rounds (``interleaved``): the worker and each strategy once per round, the order rotated by
   one each round (``round_order``), so the machine's drift and a neighbour's burst hit every
   strategy and the calibration alike; a strategy's step is the median of its rounds.
4. Print the three predictions, measured (each round's too), their ratios (target 0.67..1.5, aim
   0.8..1.25), each prediction split into compute, host and comm (``predicted_breakdown``), each
   round's flat prediction from its own worker run against the step of the same round
   (``paired_ratios``: both sides from one stretch of load) and whether the predicted order of the strategies is the measured one (pairs closer than half
   the range of their rounds are called ties).

On the project's shared 2-core machine 8 ranks time-share two cores, so the host overhead
dominates and the numbers move with the other jobs on the box; run it a few times.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from simulator import calibrate_host
from simulator.calibrate_host import kernel_scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")
DEFAULT_STRATEGIES = "dp=8;dp=2,tp=4;dp=1,tp=2,pp=4"
HOST = "host costs"
"""The worker's measurement, a run of its own in each round's order."""
GLOBAL_BATCH = 16


SEQ, VOCAB = 64, 128
GPT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "block_size": SEQ,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "dropout": 0.0,
    "dtype": "float32",
}
"""gpt.py's default model (what ``gpt_step`` traces and the worker's kernel probe runs)."""
KERNEL_BATCHES = calibrate_host.KERNEL_BATCHES
"""Per-rank micro-batches of the kernel probe: dp=8's (16 / 8) and a pipeline stage's (all 16)."""
PROBE_LAYERS, PROBE_BATCH = 2, 1
"""The step probe (``opt x``, ``comm x``): gpt.py's model cut to 2 layers, 1 sequence per rank.
It differs from every checked strategy (4 layers; dp=8 runs 2 sequences per rank), so no
strategy's optimizer phase or collectives are measured rather than predicted: fewer
gradients, hence fewer calls and a smaller update, and half the work between the calls."""

GAP_GRID = (0.0, 3e-4, 1e-3, 3e-3, 1e-2)
"""Seconds of work between collectives at which the worker times an all-reduce (interpolated)."""
GROUP_SIZES = (2, 4, 8)
"""Group sizes the worker times its all-reduces over: every group a mesh of 8 ranks can form."""
COLLECTIVE_PASSES = 9
"""Paired (with, without the collective) batches per gap in one worker run: their median is the cost."""
MESSAGE_BYTES = (1024, 65536, 524288)
"""Each rank's buffer in the worker's all-reduces: 1 KiB (the latency, every pass) and the sizes
a step moves (gpt.py's gradients up to 256 KiB, a pipeline stage's activations 512 KiB). On
ranks time-sharing cores a large message costs far more amid work than the link's bandwidth
says (about 2.5 ms for 512 KiB over 2 ranks after 3-10 ms of work, against 0.5 ms at the
calibrated bandwidth): the copy needs both ranks on a core at once, and each time one is
descheduled the other waits."""
SIZE_PASSES = 5
"""Passes of ``COLLECTIVE_PASSES`` that also time the larger ``MESSAGE_BYTES`` (fewer: they are slower)."""


# ---------------------------------------------------------------------- worker (under mpiexec)
class GapProbe:
    """An mpipar all-reduce (1 KiB) after units of NumPy work, every rank at once (under
    ``mpiexec``): what a collective costs after a gap of work (the worker's curve, and
    ``collective_sequence.py``'s replay of a step's gaps). ``per_unit`` is one unit's seconds,
    measured when the probe is made."""

    def __init__(self, comm: Any) -> None:
        import numpy as np

        import mpipar as dist

        self.comm, self._np, self._dist = comm, np, dist
        self.unit = np.full(4096, 0.5, dtype=np.float32)
        comm.Barrier()
        start = time.perf_counter()
        self.work(200)
        self.per_unit = (time.perf_counter() - start) / 200

    def work(self, units: int) -> None:
        unit, tanh = self.unit, self._np.tanh
        for _ in range(units):
            tanh(unit * unit + unit)

    def units(self, gap: float) -> int:
        """Units of work that take ``gap`` seconds."""
        return round(gap / self.per_unit)

    def partial(self, ranks: list[int], nbytes: int = MESSAGE_BYTES[0]) -> Any:
        """A Partial tensor over ``ranks`` (``nbytes`` of float32 on each) whose reshard to
        Replicate is the all-reduce."""
        dist = self._dist
        group = dist.ProcessMesh(ranks, dim_names=["g"])
        return dist.dtensor_from_local(self._np.ones(nbytes // 4, dtype=self._np.float32), group, [dist.Partial()])

    def all_reduce(self, partial: Any) -> None:
        self._dist.reshard(partial, partial.spec.mesh, [self._dist.Replicate()])

    def loop(self, partial: Any, with_collective: bool, reps: int, units: int) -> float:
        """Seconds per repetition of ``units`` of work, each followed by the all-reduce of
        ``partial`` when ``with_collective``."""
        self.comm.Barrier()
        start = time.perf_counter()
        for _ in range(reps):
            self.work(units)
            if with_collective:
                self.all_reduce(partial)
        return (time.perf_counter() - start) / reps

    def paired(self, partial: Any, gap: float, period: float = 1e-3) -> float:
        """One paired batch at ``gap``: the extra seconds per all-reduce (with minus without),
        about 0.1 s of repetitions of at least ``period`` seconds each."""
        units = self.units(gap)
        reps = max(8, int(0.1 / max(gap, period)))
        return self.loop(partial, True, reps, units) - self.loop(partial, False, reps, units)


def worker(steps: int) -> None:
    """Each rank: host costs (``simulator.calibrate_host.host_costs``: tiny GPT steps on its own
    mesh), the kernel probe, NumPy's elementwise and GEMM rates, and all-reduces after each gap
    of ``GAP_GRID`` seconds of work."""
    import numpy as np
    from mpi4py import MPI

    import mpipar as dist
    from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
    from simulator import calibrate_host

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    # Host seconds per op and per parameter update: calibrate's own measurement, taken again now.
    host = calibrate_host.host_costs(comm, steps)
    per_op, per_update = host["op"], host["update"]

    def model_probe(
        batch: int, data_parallel: bool = False, layers: int = GPT_CONFIG["n_layer"]
    ) -> tuple[float, float]:
        """Median seconds of forward+backward of gpt.py's model with ``layers`` layers, ``batch``
        sequences per rank, and of its clipped AdamW update (gpt.py's optimizer), every rank at
        once: on this rank's one-rank mesh, or (``data_parallel``) data parallel over all ranks,
        whose backward all-reduces each gradient (update not timed: 0)."""
        world = comm.Get_size()
        dist.seed(0)
        if data_parallel:
            par = GPTParallel.from_degrees(world, 1, 1)
            mesh = par.stage_meshes[0]
        else:
            mesh = dist.ProcessMesh([[rank]], dim_names=["dp", "tp"])
            par = GPTParallel([mesh])
        rows = batch * (world if data_parallel else 1)
        model = GPT(GPTConfig(**{**GPT_CONFIG, "n_layer": layers}), par)
        opt = dist.optimizer.AdamW(
            learning_rate=3e-3,
            parameters=model.parameters(),
            weight_decay=0.01,
            grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0),
        )
        idx = dist.shard_tensor(
            np.arange(rows * SEQ, dtype=np.int64).reshape(rows, SEQ) % VOCAB,
            mesh,
            par.activation(mesh, seq_split=False),
        )

        def once() -> tuple[float, float]:
            start = time.perf_counter()
            model.loss(idx, idx).backward()
            mid = time.perf_counter()
            if data_parallel:
                model.clear_gradients()
                return mid - start, 0.0
            opt.step()
            opt.clear_grad()
            return mid - start, time.perf_counter() - mid

        once()
        comm.Barrier()
        times = [once() for _ in range(3)]
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    # The kernels' own cost at training sizes: the same model at the smallest and the largest
    # per-rank micro-batch of the strategies (same ops, same host overhead; only the kernels
    # grow), twice in turn, the better of each (a neighbour's burst spoils one, not both). The
    # step probe (``PROBE_LAYERS`` layers, ``PROBE_BATCH`` sequence per rank: unlike any checked
    # strategy) times its clipped AdamW update (``probe_update``: what an optimizer phase costs
    # in a step) and its forward+backward on one-rank meshes (``probe_fb``) and data parallel
    # over all ranks (``dp_fb``: the same per-rank work with each gradient all-reduced in the
    # backward, collectives as a training step pays them).
    probe: dict[int, list[float]] = {b: [] for b in KERNEL_BATCHES}
    step_probe: dict[str, list[float]] = {"probe_fb": [], "probe_update": [], "dp_fb": []}
    for _ in range(2):
        for b in KERNEL_BATCHES:
            probe[b].append(model_probe(b)[0])
        fb, update = model_probe(PROBE_BATCH, layers=PROBE_LAYERS)
        step_probe["probe_fb"].append(fb)
        step_probe["probe_update"].append(update)
        step_probe["dp_fb"].append(model_probe(PROBE_BATCH, data_parallel=True, layers=PROBE_LAYERS)[0])
    # Elementwise passes (add, multiply, exp, tanh: one FLOP per element each in op_cost's table)
    # over 64 KiB arrays, all ranks at once.
    x = np.full(16384, 0.5, dtype=np.float32)
    comm.Barrier()
    reps = 500
    start = time.perf_counter()
    for _ in range(reps):
        np.tanh(np.exp(x * x + x))
    vector = 4 * x.size * reps / (time.perf_counter() - start)
    # The GEMM rate as calibrate measures it (512x512, every rank at once), now: the kernel
    # probe's ratio is then against rates taken at the same load, not the profile's.
    a = np.full((512, 512), 0.5, dtype=np.float32)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    gemm = 2 * 512**3 * 10 / (time.perf_counter() - start)
    # An mpipar all-reduce (1 KiB) over groups of 2, 4 and 8 ranks after ``gap`` seconds of
    # NumPy work on every rank (all at once, as training interleaves them), for each gap of
    # the grid. What a collective costs here depends on that gap: 8 ranks time-sharing 2
    # cores drift apart while they work, and the collective waits for the last one.
    probe_gap = GapProbe(comm)
    out: dict[str, float] = {
        "op": per_op,
        "update": per_update,
        "vector_flops": vector,
        "gemm_flops": gemm,
        **{f"model_fb{b}": min(ts) for b, ts in probe.items()},
        **{k: min(ts) for k, ts in step_probe.items()},
    }
    for n in GROUP_SIZES:
        group = [rank // n * n + i for i in range(n)]
        partials = {size: probe_gap.partial(group, size) for size in MESSAGE_BYTES}
        for partial in partials.values():
            probe_gap.loop(partial, True, 3, 0)
        # Paired batches (with and without the collective), the gaps and sizes interleaved pass
        # after pass so a neighbour's burst or a drift of the machine hits every gap alike; the
        # median of COLLECTIVE_PASSES pairs per gap (SIZE_PASSES for the larger messages).
        samples: dict[tuple[int, int], list[float]] = {
            (size, g): [] for size in MESSAGE_BYTES for g in range(len(GAP_GRID))
        }
        for pass_ in range(COLLECTIVE_PASSES):
            for g, gap in enumerate(GAP_GRID):
                for size, partial in partials.items():
                    latency = size == MESSAGE_BYTES[0]
                    if (
                        latency or pass_ < SIZE_PASSES
                    ):  # a large all-reduce takes ms itself: fewer passes and repetitions
                        samples[(size, g)].append(probe_gap.paired(partial, gap, period=1e-3 if latency else 5e-3))
        for (size, g), values in samples.items():
            out[allreduce_key(n, g, size)] = max(statistics.median(values), 0.0)
    rows = comm.gather(out, root=0)
    if rank == 0:
        print(json.dumps({k: statistics.median(r[k] for r in rows) for k in rows[0]}))


def gpt_training_parts(par: Any, mesh: Any, batch: int) -> tuple[Any, Any, Any]:
    """gpt.py's default model on ``par``, its clipped AdamW, and ``batch`` token rows sharded
    on ``mesh`` as gpt.py shards its batches (the step the benchmarks time)."""
    import numpy as np

    import mpipar as dist
    from mpipar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(**GPT_CONFIG), par)
    opt = dist.optimizer.AdamW(
        learning_rate=3e-3,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0),
    )
    rows = np.arange(batch * SEQ, dtype=np.int64).reshape(batch, SEQ) % VOCAB
    return model, opt, dist.shard_tensor(rows, mesh, par.activation(mesh, seq_split=False))


def worker_json(script: str, args: list[str]) -> dict[str, Any]:
    """Run ``script`` with ``args`` on 8 ranks under ``mpiexec`` (one BLAS thread each, no stdin,
    10 minutes at most) and return the JSON object its rank 0 prints on a line of its own (the
    workers of this benchmark, ``no_comm_step.py`` and ``collective_sequence.py``)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [MPIEXEC, "-n", "8", sys.executable, os.path.abspath(script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
        check=True,
    )
    line = next((line for line in out.stdout.splitlines() if line.startswith("{")), None)
    if line is None:
        raise RuntimeError(
            f"{os.path.basename(script)} {' '.join(args)}: rank 0 printed no JSON result; stderr ends: {out.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(line)
    return result


def host_costs(steps: int) -> dict[str, float]:
    return worker_json(__file__, ["--worker", "--steps", str(steps)])


# ---------------------------------------------------------------------- predict and measure
def degrees(text: str) -> dict[str, int]:
    from simulator.estimate import parse_mesh

    return parse_mesh(text)


def allreduce_key(n: int, gap_index: int, nbytes: int = MESSAGE_BYTES[0]) -> str:
    """The worker's key of its all-reduce over ``n`` ranks after ``GAP_GRID[gap_index]`` seconds
    of work with ``nbytes`` on each rank (the 1 KiB probe's key carries no size)."""
    return f"allreduce{n}_{gap_index}" if nbytes == MESSAGE_BYTES[0] else f"allreduce{n}_{gap_index}_{nbytes}"


def _over_gaps(host: dict[str, float], n: int, gap: float, nbytes: int) -> float:
    """The worker's cost of the ``nbytes`` all-reduce over ``n`` ranks after ``gap`` seconds of
    work: linear between the grid's gaps, the last one's beyond it."""
    points = [(g, host[allreduce_key(n, i, nbytes)]) for i, g in enumerate(GAP_GRID)]
    if gap >= points[-1][0]:
        return points[-1][1]
    for (g0, c0), (g1, c1) in itertools.pairwise(points):
        if gap <= g1:
            return c0 + (c1 - c0) * (max(gap, g0) - g0) / (g1 - g0)
    raise AssertionError("unreachable")


def at_gap(host: dict[str, float], n: int, gap: float, nbytes: float = MESSAGE_BYTES[0]) -> float:
    """The worker's all-reduce cost over ``n`` ranks after ``gap`` seconds of work, ``nbytes`` on
    each rank: linear in the gap between the grid's, and in the size between the measured
    ``MESSAGE_BYTES`` (the last two sizes' line beyond them; the 1 KiB cost below); sizes the
    worker did not time (a host dict from an older worker) are priced at 1 KiB."""
    sizes = [b for b in MESSAGE_BYTES if allreduce_key(n, 0, b) in host]
    costs = [_over_gaps(host, n, gap, b) for b in sizes]
    if len(sizes) < 2 or nbytes <= sizes[0]:
        return costs[0]
    i = next((k for k in range(1, len(sizes)) if nbytes <= sizes[k]), len(sizes) - 1)
    (b0, c0), (b1, c1) = (sizes[i - 1], costs[i - 1]), (sizes[i], costs[i])
    return max(c0 + (c1 - c0) * (nbytes - b0) / (b1 - b0), costs[0])


def at_size(host: dict[str, float], n: int, gap: float, nbytes: float = MESSAGE_BYTES[0]) -> float:
    """The worker's all-reduce cost over ``n`` ranks after ``gap`` seconds of work (``nbytes`` on
    each rank, ``at_gap``): a measured group size's own (``GROUP_SIZES``), linear in ``n`` between
    two measured sizes, and from the nearest two beyond them (never below 0)."""
    if n in GROUP_SIZES:
        return at_gap(host, n, gap, nbytes)
    sizes = sorted(GROUP_SIZES)
    lo, hi = next(((a, b) for a, b in itertools.pairwise(sizes) if n < b), (sizes[-2], sizes[-1]))
    c_lo, c_hi = at_gap(host, lo, gap, nbytes), at_gap(host, hi, gap, nbytes)
    return max(c_lo + (c_hi - c_lo) * (n - lo) / (hi - lo), 0.0)


class Collective(NamedTuple):
    """One reshard call of rank 0."""

    gap: float
    """Seconds of work before it."""
    steps: tuple[tuple[int, int], ...]
    """Per communication step: (group size, latency terms of its formula in
    ``simulator.cost.collective_time``: 2 (n - 1) for an all-reduce, n - 1 for the other
    collectives, 1 for a point-to-point transfer)."""
    nbytes: float = MESSAGE_BYTES[0]
    """Its size as the worker's probe measures sizes: the bytes per rank of an all-reduce over the
    first step's group that the profile's bandwidth prices as it prices this call."""
    byte_s: float = 0.0
    """Seconds the profile's bandwidth charges it (``estimate`` adds these to what the call costs)."""


def call_cost(host: dict[str, float], call: Collective) -> float:
    """What the worker measured ``call`` to cost: its first step's all-reduce at the call's gap and
    size, the later steps right after it (gap 0, 1 KiB)."""
    return sum(
        at_size(host, n, call.gap, call.nbytes) if k == 0 else at_size(host, n, 0.0)
        for k, (n, _) in enumerate(call.steps)
    )


def loaded_latency(host: dict[str, float], calls: list[Collective]) -> tuple[float, float]:
    """(alpha, base): a reshard call amid Python work costs base + alpha per latency term of its
    steps (``Collective``); together they price the plan's calls at what the worker measured for
    each: an all-reduce over the step's own group size after the call's own gap of work (its
    later steps right after the first, gap 0).

    ``alpha`` is the growth from groups of 2 to 8 (small buffers: the latency terms are all
    there is), on average over the plan's gaps; ``base`` is what the plan's calls cost beyond
    it, per call. Groups of 4 are measured too: on ranks time-sharing cores an all-reduce over 4
    costs more than the ring's line between 2 and 8 says (the wait for the slowest member grows
    faster than the ring's terms), so the total is the measured sizes', not the formula's.
    """
    calls = calls or [Collective(0.0, ((2, 2),))]
    gaps = [c.gap for c in calls]
    two = statistics.fmean(at_gap(host, 2, g) for g in gaps)
    eight = statistics.fmean(at_gap(host, 8, g) for g in gaps)
    alpha = max(eight - two, 0.0) / (2 * (8 - 2))
    # ``estimate`` charges each call's bytes at the profile's bandwidth (``byte_s``) on top of
    # base and alpha: what the worker measured beyond that is theirs.
    total = sum(call_cost(host, c) - c.byte_s for c in calls)
    terms = sum(t for c in calls for _, t in c.steps)
    alpha = min(alpha, total / terms) if terms else alpha
    base = max((total - alpha * terms) / len(calls), 0.0)
    return alpha, base


def loaded_profile(profile: Any, alpha_loaded: float, kernel_scale: float = 1.0) -> Any:
    """``profile`` with the link latency ranks show between Python work on this machine and its
    kernel rates divided by ``kernel_scale`` (the flat model's ``kern x``; 1 for the curves).

    ``alpha_loaded`` replaces the profile's latency, even where it is lower: ``loaded_latency``
    splits what the worker measured the plan's calls to cost into it and a per-call base, so
    the calls cost that total only with it (calibrate's tight-loop latency, taken under other
    load, would add to what the probes already hold)."""
    from dataclasses import replace

    from simulator.cost import Link

    if not alpha_loaded >= 0 or alpha_loaded == float("inf"):
        raise ValueError(f"loaded link latency must be a finite number of seconds >= 0, got {alpha_loaded!r}")
    alpha = alpha_loaded
    link = Link(alpha, profile.intra_node.bandwidth_Bps)
    return replace(
        profile,
        name=f"{profile.name}-loaded",
        intra_node=link,
        inter_node=link,
        flops_per_s={k: v / kernel_scale for k, v in profile.flops_per_s.items()},
        vector_curve=tuple((b, r / kernel_scale) for b, r in profile.vector_curve),
        description=f"{profile.description}; link latency and kernel rates measured amid Python work by benchmarks/predict_vs_measure.py",
    )


def reference_gemm(profile: Any) -> float:
    """The profile's float32 512x512 GEMM rate (what the worker measures again): its calibration's
    raw measurement where it has one (a calibrated profile's ``flops_per_s`` is its best size
    class), else ``flops_per_s``."""
    raw = (profile.calibration or {}).get("gemm", {}).get("float32", {})
    rate = raw.get("flops_per_s") if isinstance(raw, dict) and raw.get("n") == 512 else None
    rate = rate if isinstance(rate, float | int) and rate > 0 else profile.flops_per_s.get("float32")
    if not rate or not rate > 0:
        raise ValueError(f"profile {profile.name!r}: no float32 GEMM rate (flops_per_s['float32'] is {rate!r})")
    return float(rate)


LOOP_BYTES = 2.25 * 16384 * 4
"""Bytes per pass of the worker's elementwise loop (``calibrate_host.VECTOR_PASS_ARRAYS`` arrays of 16384 float32)."""


def at_load(profile: Any, gemm_flops: float, vector_flops: float) -> Any:
    """``profile`` with its GEMM rates moved by the worker's 512x512 GEMM now against the
    profile's, and its elementwise curve by the worker's loop now against the curve at the loop's
    size: the curves keep their shape, the load moves their level."""
    from dataclasses import replace

    base = reference_gemm(profile)
    if not gemm_flops > 0 or gemm_flops == float("inf"):
        raise ValueError(f"profile {profile.name!r}: measured float32 GEMM rate {gemm_flops!r}; need > 0")
    at_loop = profile.vector_rate(LOOP_BYTES)
    vector = vector_flops / at_loop if at_loop else 1.0
    return replace(
        profile,
        flops_per_s={k: v * gemm_flops / base for k, v in profile.flops_per_s.items()},
        vector_curve=tuple((b, r * vector) for b, r in profile.vector_curve),
    )


def flat(profile: Any) -> Any:
    """``profile`` without its size-dependent kernel model: one GEMM rate (the 512x512 one) for
    every matmul, the caller's one elementwise rate (the model before the curves)."""
    from dataclasses import replace

    scale = reference_gemm(profile) / profile.flops_per_s["float32"]
    return replace(
        profile, flops_per_s={k: v * scale for k, v in profile.flops_per_s.items()}, gemm_curve=(), vector_curve=()
    )


def one_rank_step(batch: int, grad_clip: float | None = None, dp: int = 1, layers: int = GPT_CONFIG["n_layer"]) -> Any:
    """gpt.py's model with ``layers`` layers, ``batch`` sequences per rank: what the worker's
    probes run (one rank; ``grad_clip`` 1.0: with gpt.py's clipped update, as the step probe
    times it; ``dp``: data parallel over that many ranks, the step probe's ``dp_fb``)."""
    from simulator.step_trace import GPTShape, GPTStrategy, trace_gpt_step

    shape = GPTShape(
        layers=layers,
        hidden=GPT_CONFIG["n_embd"],
        heads=GPT_CONFIG["n_head"],
        seq=SEQ,
        vocab=VOCAB,
        micro_batch_size=batch,
        dropout=0.0,
    )
    return trace_gpt_step(shape, GPTStrategy(dp=dp, grad_clip=grad_clip), layers_traced=shape.layers)


def optimizer_seconds(step: Any, profile: Any, host: dict[str, float], vector_flops: float | None) -> float:
    """The optimizer phase as ``estimate`` prices it, on its busiest rank: the phase's ops (the
    global-norm clipping) at their kernel and host time, and every parameter's update (its
    kernels at the elementwise rate, ``host['update']`` each)."""
    from collections import defaultdict

    from simulator.estimate import update_seconds
    from simulator.op_cost import PlanCosts
    from simulator.step_trace import SETUP

    costs = PlanCosts(step.plan, profile, vector_flops=vector_flops, op_overhead=host["op"], reshard_overhead=0.0)
    per_rank: dict[int, float] = defaultdict(float)
    for op, part in zip(step.plan.ops, step.op_parts, strict=True):
        if part == SETUP or op.phase != "optimizer":
            continue
        times = costs.op_times(op)
        for r in costs.op_ranks(op):
            per_rank[r] += times.get(r, 0.0) if isinstance(times, dict) else times
    for updates in update_seconds(step, costs, host["update"]).values():
        for r, t in updates.items():
            per_rank[r] += t
    return max(per_rank.values(), default=0.0)


def optimizer_scale(measured: float, priced: float) -> float:
    """Measured seconds of the probe's clipped AdamW update per priced second (``opt x``). The
    kernel factor (``curve x``) is the forward+backward's growth; the update's kernels stream
    the parameters and states once each (their rate is the elementwise loop's) and the
    clipping's ops are host-bound, so the phase gets its own factor, measured on the same model."""
    for name, v in (("measured", measured), ("priced", priced)):
        if not isinstance(v, float | int) or not v > 0 or v == float("inf"):
            raise ValueError(
                f"optimizer probe: {name} seconds of the clipped AdamW update is {v!r}; expected a finite number > 0"
            )
    return measured / priced


def call_prices(host: dict[str, float], calls: list[Collective]) -> float:
    """The worker's steady-loop prices of ``calls`` (``call_cost``: each step's all-reduce at its
    group size, the first after the call's gap of work and at its size, the later ones right
    after it)."""
    return sum(call_cost(host, c) for c in calls)


def comm_scale(host: dict[str, float], calls: list[Collective]) -> float:
    """What a training backward's collectives cost per second the steady loop prices them at
    (``comm x``): the step probe's data-parallel forward+backward less the same per-rank work on
    one-rank meshes (``dp_fb - probe_fb``), over ``call_prices`` of the probe's own calls
    (``calls``: those of ``step_probes``' data-parallel step, not of any checked strategy). The loop's work is NumPy passes between 1 KiB all-reduces, every gap alike;
    between a step's calls are mpipar ops, and ranks drift apart unlike in the loop, so the
    loop's gap and group-size shape is kept and its level is the probe's."""
    for key in ("dp_fb", "probe_fb"):
        v = host.get(key)
        if not isinstance(v, float | int) or not v > 0 or v == float("inf"):
            raise ValueError(f"collective probe: {key} is {v!r}; expected a finite number of seconds > 0")
    extra = host["dp_fb"] - host["probe_fb"]
    priced = call_prices(host, calls)
    if not priced > 0:
        raise ValueError(
            f"collective probe: its {len(calls)} calls are priced at {priced!r} s; the worker's all-reduce prices are missing or 0"
        )
    if not extra > 0:
        raise ValueError(
            f"collective probe: data parallel forward+backward {host['dp_fb']:.4g} s is not above the one-rank "
            f"{host['probe_fb']:.4g} s: the machine's load changed during the probe; run again"
        )
    return extra / priced


def scaled_collectives(host: dict[str, float], factor: float) -> dict[str, float]:
    """``host`` with every all-reduce price multiplied by ``factor`` (``comm x``)."""
    if not factor > 0 or factor == float("inf"):
        raise ValueError(f"comm x must be a finite number > 0, got {factor!r}")
    return {k: v * factor if k.startswith("allreduce") else v for k, v in host.items()}


def step_probes() -> tuple[Any, Any]:
    """The step probe's traces (``PROBE_LAYERS`` layers, ``PROBE_BATCH`` sequence per rank): on
    one rank with gpt.py's clipped update (``opt x``'s price) and data parallel over 8 ranks
    (``comm x``'s calls)."""
    return (
        one_rank_step(PROBE_BATCH, grad_clip=1.0, layers=PROBE_LAYERS),
        one_rank_step(PROBE_BATCH, dp=8, layers=PROBE_LAYERS),
    )


def step_scales(
    host: dict[str, float], profile: Any, vector_flops: float | None, probe_clip: Any, probe_dp: Any
) -> tuple[float, float]:
    """(``opt x``, ``comm x``) of one kernel model (``profile``: its rates, already divided by its
    kernel factor; ``vector_flops``: its one elementwise rate, None for the curves): the step
    probe's update and its data-parallel backward's collectives (``step_probes``), measured
    against this model's prices."""
    opt_x = optimizer_scale(host["probe_update"], optimizer_seconds(probe_clip, profile, host, vector_flops))
    return opt_x, comm_scale(host, collectives(probe_dp, profile, host, vector_flops))


def forward_backward_ops(step: Any) -> list[Any]:
    """A one-rank probe step's forward and backward ops (what the worker's probe times)."""
    from simulator.step_trace import SETUP

    return [
        op
        for op, part in zip(step.plan.ops, step.op_parts, strict=True)
        if part != SETUP and op.phase in ("forward", "backward")
    ]


def kernel_seconds(step: Any, profile: Any, vector_flops: float | None) -> float:
    """The model's kernel seconds (FLOPs at the calibrated rates, no host overhead) of a one-rank
    step's forward and backward."""
    from simulator.op_cost import PlanCosts

    costs = PlanCosts(step.plan, profile, vector_flops=vector_flops, op_overhead=0.0, reshard_overhead=0.0)
    total = 0.0
    for op in forward_backward_ops(step):
        times = costs.op_times(op)
        total += times.get(0, 0.0) if isinstance(times, dict) else times
    return total


def probe_sizes(step: Any, profile: Any) -> tuple[float, float]:
    """(GEMM FLOPs, elementwise bytes) of a typical kernel of a one-rank probe step: each the
    geometric mean over its ops weighted by their priced seconds (what the probe's time is made of)."""
    from simulator.op_cost import PlanCosts

    costs = PlanCosts(step.plan, profile, op_overhead=0.0, reshard_overhead=0.0)
    sums = {"matmul": [0.0, 0.0], "vector": [0.0, 0.0]}
    for op in forward_backward_ops(step):
        kind = "matmul" if op.op == "matmul" else "vector"
        size = costs.op_flops(op, 0) if kind == "matmul" else costs.op_bytes(op, 0)
        t = costs.op_time(op, 0)
        if size > 0 and t > 0:
            sums[kind][0] += t * math.log(size)
            sums[kind][1] += t
    return tuple(math.exp(a / w) if w > 0 else 1.0 for a, w in (sums["matmul"], sums["vector"]))  # type: ignore[return-value]


def scale_by_size(measured: dict[int, float], priced: dict[int, float], host: dict[int, float]) -> dict[int, float]:
    """Per probe batch, measured kernel seconds per priced kernel second: the probe's forward+
    backward less the host seconds its ops are priced at (``op_overhead`` per op, measured by
    ``host_costs``), over its priced kernel seconds. ``kernel_scale`` is the marginal ratio between
    the two batches; this is each batch's own, so small kernels (operands in cache) and large
    ones (8 ranks' operands competing for the caches and memory) each get theirs."""
    out = {}
    for b in KERNEL_BATCHES:
        kernels = measured[b] - host[b]
        if not priced[b] > 0 or not kernels > 0:
            raise ValueError(
                f"kernel probe at micro-batch {b}: measured {measured[b]:.4g} s, of which host "
                f"{host[b]:.4g} s, priced kernels {priced[b]:.4g} s: no kernel time left; run again"
            )
        out[b] = kernels / priced[b]
    return out


def sized(profile: Any, vector_flops: float, anchors: dict[int, tuple[float, float]], scale: dict[int, float]) -> Any:
    """The flat ``profile`` (one GEMM rate, ``vector_flops``) with every kernel rate divided by
    the probe's scale at its size: linear in log size between the two probe batches' typical
    GEMM FLOPs and elementwise bytes (``probe_sizes``), level beyond them (the profile's curve
    interpolation). GEMM shares stay in (0, 1]: the rate is the fastest size's."""
    from dataclasses import replace

    least = min(scale.values())
    rate = {k: v / least for k, v in profile.flops_per_s.items()}
    gemm = sorted((anchors[b][0], least / scale[b]) for b in KERNEL_BATCHES)
    vector = sorted((anchors[b][1], vector_flops / scale[b]) for b in KERNEL_BATCHES)
    return replace(
        profile, flops_per_s=rate, compute_efficiency=1.0, gemm_curve=tuple(gemm), vector_curve=tuple(vector)
    )


def gpt_step(mesh: str) -> Any:
    """gpt.py's default model and this mesh, every layer traced (it is small)."""
    from simulator.step_trace import GPTShape, GPTStrategy, trace_gpt_step

    d = degrees(mesh)
    shape = GPTShape(
        layers=GPT_CONFIG["n_layer"],
        hidden=GPT_CONFIG["n_embd"],
        heads=GPT_CONFIG["n_head"],
        seq=SEQ,
        vocab=VOCAB,
        micro_batch_size=GLOBAL_BATCH // d["dp"],
        dropout=0.0,
    )
    strategy = GPTStrategy(dp=d["dp"], tp=d["tp"], pp=d["pp"], grad_clip=1.0)
    return trace_gpt_step(shape, strategy, layers_traced=shape.layers)


def predict(
    step: Any, profile: Any, host: dict[str, float], base: float, vector_flops: float | None, opt_x: float = 1.0
) -> float:
    """``estimate`` of ``step`` with the worker's host costs; ``vector_flops`` None: the profile's
    elementwise curve; the optimizer phase (``optimizer_seconds``) times ``opt_x``."""
    from simulator.estimate import estimate

    est = estimate(
        step.shape,
        step.strategy,
        profile,
        vector_flops=vector_flops,
        op_overhead=host["op"],
        reshard_overhead=base,
        update_overhead=host["update"],
        step=step,
    )
    if opt_x == 1.0:
        return est.step_time_s
    return est.step_time_s + (opt_x - 1.0) * optimizer_seconds(step, profile, host, vector_flops)


def latency_terms(kind: str, n: int) -> int:
    """Latency terms (alphas) of one communication step in ``simulator.cost.collective_time``."""
    if kind == "transfer":
        return 1
    if kind == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def collectives(step: Any, profile: Any, host: dict[str, float], vector_flops: float | None) -> list[Collective]:
    """Rank 0's reshard calls in one step, in plan order: the seconds of work before each and its
    communication steps' group sizes and latency terms (``Collective``).

    A reshard an op asked for runs right before that op; one no op asked for (a gradient
    going to its parameter's layout) right after the op that made its tensor. The work is the
    ops' modelled time on a link-free profile, host overhead per op included.
    """
    from dataclasses import replace

    from simulator.cost import Link, collective_time
    from simulator.op_cost import PlanCosts, _groups
    from simulator.step_trace import SETUP

    free = Link(0.0, 1e30)
    quiet = replace(profile, name="no-latency", intra_node=free, inter_node=free)
    plan = step.plan
    costs = PlanCosts(plan, quiet, vector_flops=vector_flops, op_overhead=host["op"], reshard_overhead=0.0)
    # Each call's bytes as the profile's bandwidth prices them (latency 0): its size for the
    # worker's size-dependent prices, and what ``estimate`` charges for them itself.
    zero_latency = Link(0.0, profile.intra_node.bandwidth_Bps)
    bandwidth = PlanCosts(
        plan,
        replace(
            profile, name="bytes-only", intra_node=zero_latency, inter_node=Link(0.0, profile.inter_node.bandwidth_Bps)
        ),
        reshard_overhead=0.0,
    )
    made_by = {t: op.index for op in plan.ops for t in op.outputs}
    events: list[tuple[tuple[int, int], float | tuple[Any, tuple[tuple[int, int], ...]]]] = []
    for op, part in zip(plan.ops, step.op_parts, strict=True):
        if part == SETUP or op.phase not in ("forward", "backward", "optimizer"):
            continue
        times = costs.op_times(op)
        mine = times.get(0, 0.0) if isinstance(times, dict) else (times if 0 in costs.op_ranks(op) else 0.0)
        events.append(((op.index, 1), mine))
    for res, part in zip(plan.reshards, step.reshard_parts, strict=True):
        if part == SETUP or 0 not in plan.mesh(res.src_mesh).process_ids:
            continue
        mine: list[tuple[int, int]] = []
        crossed = False
        for st in res.steps:
            if st.kind == "transfer":
                crossed = True
                if any(0 in (src, dst) and src != dst for src, dst, _ in st.pieces):
                    mine.append((2, 1))
            elif st.kind not in ("slice", "partial"):
                group = _groups(plan.mesh(res.dst_mesh if crossed else res.src_mesh), tuple(st.axes)).get(0)
                if group is not None and len(group) >= 2:
                    mine.append((len(group), latency_terms(st.kind, len(group))))
        if not mine:
            continue
        at = (res.op, 0) if res.op is not None else (made_by.get(res.tensor, -1), 2)
        events.append((at, (res, tuple(mine))))
    calls: list[Collective] = []
    work = 0.0
    for _, item in sorted(events, key=lambda e: e[0]):
        if isinstance(item, tuple):
            res, mine = item
            byte_s = bandwidth.reshard_time(res, 0)
            per_byte = collective_time("all_reduce", 1.0, mine[0][0], zero_latency, profile.reduction_Bps)
            calls.append(Collective(work, mine, byte_s / per_byte if per_byte > 0 else 0.0, byte_s))
            work = 0.0
        else:
            work += item
    return calls


def measure(
    mesh: str | None, steps: int, extra: tuple[str, ...] = (), lines: list[str] | None = None, timeout_s: float = 900.0
) -> tuple[float, float]:
    """(median, spread) seconds per step of gpt.py; spread = half the interquartile range.

    ``mesh`` None: no ``--mesh`` (``extra`` says what to run, e.g. ``--auto``); ``lines`` gets
    the run's other stdout lines."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        MPIEXEC,
        "-n",
        "8",
        sys.executable,
        os.path.join(ROOT, "examples", "gpt.py"),
        *(("--mesh", mesh) if mesh is not None else ()),
        "--steps",
        str(steps),
        "--sample",
        "0",
        *extra,
    ]
    stamps = []
    with tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err_file, stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT
        )
        # The run's wall-clock limit: a hung rank must not hang the benchmark.
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith("step "):
                    stamps.append(time.perf_counter())
                elif lines is not None:
                    lines.append(line.rstrip("\n"))
        finally:
            timer.cancel()
        proc.wait()
        err_file.seek(0)
        err = err_file.read()
    if proc.wait() != 0 or len(stamps) < 3:
        raise SystemExit(f"gpt.py {' '.join(cmd[4:])} failed (exit {proc.returncode}):\n{err[-2000:]}")
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    q = statistics.quantiles(gaps, n=4) if len(gaps) >= 2 else [gaps[0]] * 3
    return statistics.median(gaps), (q[2] - q[0]) / 2


T = TypeVar("T")


def round_order(names: list[str], round_: int) -> list[str]:
    """The run order of round ``round_`` (from 0): ``names`` rotated by one place per round, so over
    ``len(names)`` rounds every run has been in every position once (a machine that drifts within
    a round, or a run that slows the one after it, hits each alike)."""
    if not names:
        return []
    k = round_ % len(names)
    return names[k:] + names[:k]


def interleaved(names: list[str], rounds: int, run: Callable[[str, int], T]) -> dict[str, list[T]]:
    """``run(name, round)`` for every name, ``rounds`` rounds, in ``round_order``: per name its
    results in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    out: dict[str, list[T]] = {n: [] for n in names}
    for r in range(rounds):
        for name in round_order(names, r):
            out[name].append(run(name, r))
    return out


def steady(rows: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, tuple[float, float]]]:
    """One set of host costs for every strategy: per constant the median over the worker's runs,
    and its (least, largest) as the spread."""
    if not rows:
        raise ValueError("no worker measurements to combine")
    keys = set(rows[0])
    for i, row in enumerate(rows):
        if set(row) != keys:
            raise ValueError(f"worker run {i}: constants {sorted(set(row) ^ keys)} differ from run 0's")
        for k, v in row.items():
            if not isinstance(v, float | int) or not v >= 0 or v == float("inf"):
                raise ValueError(f"worker run {i}: {k} is {v!r}; expected a finite number >= 0")
    med = {k: float(statistics.median(r[k] for r in rows)) for k in rows[0]}
    return med, {k: (float(min(r[k] for r in rows)), float(max(r[k] for r in rows))) for k in rows[0]}


def round_spread(values: list[float]) -> float:
    """Half the range of a run's per-round medians (0 for one round)."""
    return (max(values) - min(values)) / 2 if values else 0.0


def round_scales(profile: Any, probes: dict[int, Any], rows: list[dict[str, float]]) -> list[float]:
    """``kern x`` of each worker run on its own (its probe against the flat rates it measured):
    the spread the median set smooths out."""
    out = []
    for row in rows:
        level = flat(at_load(profile, row["gemm_flops"], row["vector_flops"]))
        out.append(
            kernel_scale(
                {b: row[f"model_fb{b}"] for b in KERNEL_BATCHES},
                {b: kernel_seconds(probes[b], level, row["vector_flops"]) for b in KERNEL_BATCHES},
            )
        )
    return out


def flat_predict(
    step: Any, profile: Any, probes: dict[int, Any], host: dict[str, float], probe_clip: Any, probe_dp: Any
) -> float:
    """The flat model's step (``flat s``) from one set of worker constants: the profile's rates
    moved to the worker's GEMM and elementwise rates, divided by that set's ``kern x``, the
    optimizer phase times its ``opt x``, each collective at its own size and gap times its
    ``comm x`` (``step_scales`` on the probes ``probe_clip`` and ``probe_dp``)."""
    level = flat(at_load(profile, host["gemm_flops"], host["vector_flops"]))
    scale = kernel_scale(
        {b: host[f"model_fb{b}"] for b in KERNEL_BATCHES},
        {b: kernel_seconds(probes[b], level, host["vector_flops"]) for b in KERNEL_BATCHES},
    )
    trained = host["vector_flops"] / scale
    free = loaded_profile(level, 0.0, scale)
    opt_x, comm_x = step_scales(host, free, trained, probe_clip, probe_dp)
    host = scaled_collectives(host, comm_x)
    alpha, base = loaded_latency(host, collectives(step, free, host, trained))
    return predict(step, loaded_profile(level, alpha, scale), host, base, trained, opt_x)


def paired_ratios(predicted: list[float], measured: list[float]) -> tuple[list[float], float]:
    """Per round, the prediction from that round's worker run over the step measured in the same
    round, and their median: both sides from one stretch of the machine's load."""
    if len(predicted) != len(measured) or not predicted:
        raise ValueError(f"paired rounds: {len(predicted)} predictions for {len(measured)} measured steps")
    for i, m in enumerate(measured):
        if not m > 0 or m == float("inf"):
            raise ValueError(f"paired rounds: measured step of round {i + 1} is {m!r}; expected a finite number > 0")
    ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
    return ratios, statistics.median(ratios)


def predicted_breakdown(
    step: Any, profile: Any, host: dict[str, float], base: float, vector_flops: float | None, opt_x: float = 1.0
) -> dict[str, float]:
    """The prediction split into ``compute`` (kernels alone: free links, no host time), ``host``
    (what the per-op and per-update host seconds add) and ``comm`` (what the links and each
    collective's call cost add on top), each the difference of two estimates (the optimizer
    phase times ``opt_x`` in each)."""
    from dataclasses import replace

    from simulator.cost import Link

    free = Link(0.0, 1e30)
    quiet = replace(profile, intra_node=free, inter_node=free)
    full = predict(step, profile, host, base, vector_flops, opt_x)
    no_comm = predict(step, quiet, host, 0.0, vector_flops, opt_x)
    compute = predict(step, quiet, {**host, "op": 0.0, "update": 0.0}, 0.0, vector_flops, opt_x)
    return {"compute": compute, "host": no_comm - compute, "comm": full - no_comm}


def order_agrees(
    names: list[str], predicted: list[float], measured: list[float], spread: list[float]
) -> tuple[bool, list[str]]:
    """Every pair ordered alike, except pairs the measurement cannot tell apart (ties)."""
    ties = []
    ok = True
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            if abs(measured[i] - measured[j]) <= spread[i] + spread[j]:
                ties.append(f"{names[i]} ~ {names[j]}")
                continue
            ok &= (predicted[i] < predicted[j]) == (measured[i] < measured[j])
    return ok, ties


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a hardware profile JSON to reuse (default: calibrate -n 8 now)")
    parser.add_argument("--steps", type=int, default=10, help="gpt.py steps per strategy (the first is excluded)")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="';'-separated --mesh values")
    # curves is the default: it is the size-dependent model issue #16 asks for and the one
    # ``estimate`` prices kernels with on a calibrated CPU profile (gemm_curve, vector_curve),
    # with the probe's in-step scale on top; flat and sized are kept as cross-checks.
    parser.add_argument(
        "--model",
        choices=("flat", "curves", "sized"),
        default="curves",
        help="which prediction the order check uses: curves (the profile's rates by size, / curve x; "
        "the default, as estimate prices kernels), flat (one rate each, / kern x) or sized (one rate "
        "each, / the probe's scale at each kernel's size)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds (worker and every strategy once each, order rotated); medians of the rounds",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.steps < 3 or ns.rounds < 1:
        parser.error(f"--steps must be >= 3 and --rounds >= 1, got {ns.steps} and {ns.rounds}")
    if ns.worker:
        worker(ns.steps)
        return
    sys.path.insert(0, ROOT)
    from simulator.cost import load_profile

    if ns.profile:
        profile = load_profile(ns.profile)
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="mpipar-calibrate-"), "profile.json")
        subprocess.run(
            [sys.executable, "-m", "simulator", "calibrate", "-n", "8", "-o", path],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        profile = load_profile(path)
        print(f"calibrated (mpiexec -n 8): {path}")
    # The one model: what --auto, estimate and the dashboard price on this profile, printed beside
    # the measured steps. The decompositions below measure their own kernel scale at this load.
    calibrated = profile
    profile = dataclasses.replace(profile, kernel_scale=1.0)
    link = profile.intra_node
    print(
        f"  links: alpha {link.alpha_s * 1e6:.1f} us, {link.bandwidth_Bps / 1e9:.2f} GB/s; GEMM float32 "
        f"{profile.flops_per_s.get('float32', 0) / 1e9:.1f} GFLOP/s per rank ({os.cpu_count()} CPUs for 8 ranks)"
    )
    names = [s.strip() for s in ns.strategies.split(";") if s.strip()]
    probes = {b: one_rank_step(b) for b in KERNEL_BATCHES}
    probe_clip, probe_dp = step_probes()
    probe_ops = {b: len(forward_backward_ops(probes[b])) for b in KERNEL_BATCHES}
    curves = bool(profile.gemm_curve and profile.vector_curve)
    if not curves:
        print(
            "  (this profile has no gemm_curve/vector_curve: the prediction falls back to the flat model; "
            "recalibrate with `python -m simulator calibrate -n 8`)"
        )
    steps = {mesh: gpt_step(mesh) for mesh in names}

    # Rounds: the worker's host-cost measurement and every strategy's gpt.py run once per round,
    # in an order rotated each round; every measured number is the median of its rounds. Load
    # drift and a neighbour's burst then hit the strategies and the calibration alike, and all
    # three predictions use one set of host costs (a noisy measurement taken just before one
    # strategy no longer inflates that strategy alone).
    def run(name: str, round_: int) -> Any:
        if name == HOST:
            out: Any = host_costs(20)
            what = f"op {out['op'] * 1e6:.0f} us, all-reduce(8) after 1 ms {out['allreduce8_2'] * 1e6:.0f} us"
        else:
            out = measure(name, ns.steps)
            what = f"{out[0]:.4f} s/step"
        print(f"  round {round_ + 1}: {name:<16} {what}  (load average {os.getloadavg()[0]:.1f})", flush=True)
        return out

    load_start = os.getloadavg()
    results = interleaved([HOST, *names], ns.rounds, run)
    load_end = os.getloadavg()
    host, host_range = steady(results[HOST])
    measured = [statistics.median(m for m, _ in results[mesh]) for mesh in names]
    spread = [round_spread([m for m, _ in results[mesh]]) if ns.rounds > 1 else results[mesh][0][1] for mesh in names]

    print(f"\nhost costs over {ns.rounds} worker run(s): median [least .. largest]")
    labels = {
        key: key
        for key in (
            "op",
            "update",
            "vector_flops",
            "gemm_flops",
            *(f"model_fb{b}" for b in KERNEL_BATCHES),
            "probe_fb",
            "probe_update",
            "dp_fb",
        )
    }
    labels.update(
        {
            allreduce_key(n, g, b): f"all-reduce({n}) {b // 1024:>3} KiB after {gap * 1e3:g} ms"
            for n in GROUP_SIZES
            for b in MESSAGE_BYTES
            for g, gap in enumerate(GAP_GRID)
        }
    )
    for key, label in labels.items():
        if key not in host:  # a worker from before the sizes were timed
            continue
        unit, factor = (
            ("GF/s", 1e-9)
            if key.endswith("flops")
            else ("ms", 1e3)
            if key.startswith(("model", "probe", "dp_"))
            else ("us", 1e6)
        )
        lo, hi = host_range[key]
        rel = (hi - lo) / host[key] if host[key] else 0.0
        print(
            f"  {label:<36} {host[key] * factor:>9.2f} [{lo * factor:.2f} .. {hi * factor:.2f}] {unit}  (+-{rel / 2:.0%})"
        )

    now = at_load(profile, host["gemm_flops"], host["vector_flops"])
    measured_fb = {b: host[f"model_fb{b}"] for b in KERNEL_BATCHES}
    # The flat model (one GEMM rate, one elementwise rate, every kernel divided by ``kern x``,
    # the probe's growth over its priced growth) beside the size-dependent one (the profile's
    # curves, no factor; ``curve x`` is the same probe's ratio against them, 1 if they hold).
    level = flat(now)
    level_priced = {b: kernel_seconds(probes[b], level, host["vector_flops"]) for b in KERNEL_BATCHES}
    scale = kernel_scale(measured_fb, level_priced)
    trained = host["vector_flops"] / scale
    # The flat rates divided by each probe batch's own scale, at the sizes of its kernels.
    by_size = scale_by_size(measured_fb, level_priced, {b: probe_ops[b] * host["op"] for b in KERNEL_BATCHES})
    by_size_model = sized(
        level, host["vector_flops"], {b: probe_sizes(probes[b], level) for b in KERNEL_BATCHES}, by_size
    )
    model = now if curves else level
    vec = None if curves else host["vector_flops"]
    curve_x = kernel_scale(measured_fb, {b: kernel_seconds(probes[b], model, vec) for b in KERNEL_BATCHES})
    vec_x = None if vec is None else vec / curve_x
    # Per kernel model, the optimizer phase's factor (the probe's clipped update against its
    # price) and the collectives' (the probe's data-parallel backward against the steady
    # loop's prices of its calls): each term priced from a probe that pays it as a step does.
    scales = {
        "flat": step_scales(host, loaded_profile(level, 0.0, scale), trained, probe_clip, probe_dp),
        "curves": step_scales(host, loaded_profile(model, 0.0, curve_x), vec_x, probe_clip, probe_dp),
        "sized": step_scales(host, by_size_model, None, probe_clip, probe_dp),
    }
    hosts = {k: scaled_collectives(host, c) for k, (_, c) in scales.items()}
    predicted, rows, parts = [], [], []
    for mesh, m, sp in zip(names, measured, spread, strict=True):
        step = steps[mesh]
        sized_alpha, sized_base = loaded_latency(hosts["sized"], collectives(step, by_size_model, host, None))
        sized_p = predict(step, loaded_profile(by_size_model, sized_alpha), host, sized_base, None, scales["sized"][0])
        flat_calls = collectives(step, loaded_profile(level, 0.0, scale), host, trained)
        flat_alpha, flat_base = loaded_latency(hosts["flat"], flat_calls)
        flat_model = loaded_profile(level, flat_alpha, scale)
        flat_p = predict(step, flat_model, host, flat_base, trained, scales["flat"][0])
        # The curves' rates, each divided by what the probe still measures beyond them
        # (``curve x``), so the size dependence and the training-step slowdown both hold.
        alpha, base = loaded_latency(
            hosts["curves"], collectives(step, loaded_profile(model, 0.0, curve_x), host, vec_x)
        )
        curve_model = loaded_profile(model, alpha, curve_x)
        p = predict(step, curve_model, host, base, vec_x, scales["curves"][0])
        # The headline is the model chosen by --model; all are printed.
        headline = {"curves": p, "flat": flat_p, "sized": sized_p}[ns.model]
        predicted.append(headline)
        parts.append(
            {
                "flat": predicted_breakdown(step, flat_model, host, flat_base, trained, scales["flat"][0]),
                "curves": predicted_breakdown(step, curve_model, host, base, vec_x, scales["curves"][0]),
            }
        )
        rows.append(
            (
                mesh,
                statistics.median(c.gap for c in flat_calls) if flat_calls else 0.0,
                flat_alpha,
                flat_base,
                flat_p,
                alpha,
                base,
                p,
                m,
                sp,
                sized_p,
            )
        )
    print(
        f"\nkern x {scale:.2f} (flat), curve x {curve_x:.2f} (curves), x at {'/'.join(map(str, KERNEL_BATCHES))} "
        f"{'/'.join(f'{by_size[b]:.2f}' for b in KERNEL_BATCHES)} (sized), from the median probe; "
        f"each worker run's own kern x {'/'.join(f'{x:.2f}' for x in round_scales(profile, probes, results[HOST]))}"
    )
    print(
        "opt x (the clipped update, measured over priced) and comm x (the data-parallel backward's collectives, "
        "measured over the steady loop's prices): " + ", ".join(f"{k} {o:.2f}/{c:.2f}" for k, (o, c) in scales.items())
    )

    def mark(ratio: float) -> str:
        return f"{ratio:.2f} " + ("ok" if 0.8 <= ratio <= 1.25 else ("target" if 0.67 <= ratio <= 1.5 else "OUT"))

    print(
        f"\n{'strategy':<16} {'gap ms':>6} {'call us':>7} {'alpha us':>8} {'flat s':>7} {'curve/x s':>9} {'sized s':>7} "
        f"{'measured s':>10} {'+-':>6} {'rounds s':>20} {'flat/meas':>9} {'curve/x/meas':>12} {'sized/meas':>10}"
    )
    for mesh, gap, flat_alpha, flat_base, flat_p, _alpha, _base, p, m, sp, sized_p in rows:
        each = "/".join(f"{x:.3f}" for x, _ in results[mesh])
        print(
            f"{mesh:<16} {gap * 1e3:>6.2f} {flat_base * 1e6:>7.0f} {flat_alpha * 1e6:>8.0f} {flat_p:>7.4f} {p:>9.4f} "
            f"{sized_p:>7.4f} {m:>10.4f} {sp:>6.3f} {each:>20} {mark(flat_p / m):>9} {mark(p / m):>12} {mark(sized_p / m):>10}"
        )
    print(
        f"\n{'predicted':<16} {'flat: compute':>13} {'host':>7} {'comm':>7} {'curve/x: compute':>16} {'host':>7} {'comm':>7}  (s)"
    )
    for mesh, part in zip(names, parts, strict=True):
        f, c = part["flat"], part["curves"]
        print(
            f"{mesh:<16} {f['compute']:>13.4f} {f['host']:>7.4f} {f['comm']:>7.4f} {c['compute']:>16.4f} {c['host']:>7.4f} {c['comm']:>7.4f}"
        )
    print(f"\n{'paired rounds':<16} {'flat s per round':>24} {'flat/meas per round':>20} {'median':>11}")
    for mesh in names:
        each = [flat_predict(steps[mesh], profile, probes, h, probe_clip, probe_dp) for h in results[HOST]]
        ratios, mid = paired_ratios(each, [m for m, _ in results[mesh]])
        print(
            f"{mesh:<16} {'/'.join(f'{x:.3f}' for x in each):>24} {'/'.join(f'{r:.2f}' for r in ratios):>20} {mark(mid):>11}"
        )
    print(
        "(gap: the median work before one of rank 0's collectives; call + 2(n-1) alpha: an n-rank all-reduce, averaged "
        "over the plan's collectives, each after its own gap of work (the flat model's gaps); flat: one GEMM and one "
        "elementwise rate divided by kern x; curve/x: the profile's rates by size divided by curve x; sized: the "
        "flat rates divided by each probe batch's own scale, interpolated in log kernel size; measured: the median "
        "of the rounds' medians, +- half their range; compute: kernels alone, host: the per-op and per-update host "
        "time, comm: links and collective calls; paired rounds: each round's worker run prices the flat model, "
        "against the step measured in the same round)"
    )
    from simulator.estimate import estimate

    print(
        f"\n{'one model':<16} {'profile s':>9} {'measured s':>10} {'profile/meas':>12}  (estimate on the calibrated "
        f"profile, kernel_scale {calibrated.kernel_scale:.2f}: what --auto, estimate and the dashboard price)"
    )
    for mesh, m in zip(names, measured, strict=True):
        one = estimate(steps[mesh].shape, steps[mesh].strategy, calibrated, step=steps[mesh]).step_time_s
        print(f"{mesh:<16} {one:>9.4f} {m:>10.4f} {mark(one / m):>12}")
    print(
        f"load average {load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f} at the start, "
        f"{load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f} at the end ({os.cpu_count()} CPUs)"
    )
    ok, ties = order_agrees(names, predicted, measured, spread)
    by_pred = " < ".join(n for _, n in sorted(zip(predicted, names, strict=True)))
    by_meas = " < ".join(n for _, n in sorted(zip(measured, names, strict=True)))
    print(f"\npredicted order: {by_pred}\nmeasured order:  {by_meas}")
    print(
        f"order matches: {'yes' if ok else 'no'}"
        + (f" (ties within the measured spread: {', '.join(ties)})" if ties else "")
    )


if __name__ == "__main__":
    main()
