"""``estimate``'s numbers without a trace per strategy: the search's fast path.

``estimate`` traces the whole step under one strategy (every rank, every stage) and prices it,
and a trace grows with the ranks and stages it lays out. The search prices
thousands of strategies that differ only in how the same layers are arranged, so this module
splits ``estimate`` along what each number depends on:

* **invariant costs** (``InvariantCosts``): every op and reshard of the forward and backward
  that is not about parameters' data parallelism -- compute, tensor-parallel collectives,
  pipeline hand-offs, activations kept -- depends on the micro-batch size, ``tp``, sequence
  parallelism, recompute and the dtype, not on ``dp``, ``pp``, ZeRO or the schedule. One
  shape-only trace with ``dp = 1`` and two pipeline stages of two layers each gives them.
* **data-parallel costs** (``ContextCosts``): gradient reductions, ZeRO's gathers and
  reduce-scatters, the optimizer's ops and updates, and the model state, all of them on
  parameter-shaped tensors: they depend on ``tp``, sequence parallelism, ZeRO (and recompute
  under ZeRO-3, whose backward re-gathers) and ``dp``, not on the micro-batch size. One trace
  with ``dp = 2`` (``1`` for ``dp = 1``) records them; ``ContextCosts.at(dp)`` re-prices each
  on the real ``dp x tp`` meshes (group sizes, link classes, local shapes, ZeRO splits).
* **assembly** (``assemble``): ``estimate``'s own arithmetic -- layers per stage, the traced
  interior and last layer of a stage scaled to its real layers, the first/last parts, the
  hand-offs priced on the link between the two pipeline ranks, the schedule simulated
  (``simulate_schedule``; beyond a few rounds the makespan, lane ends and activations in flight
  grow by the same amount per round, checked on three points, so a long step is
  extrapolated), gradient reduction and optimizer as each lane's tail, peaks per lane.

The result equals ``estimate``'s step time and peak memory where every rank of a group does the
same work (even shards; ``tests/unit/test_search_fast.py`` checks several strategies), which holds
for the search's candidates; ``applicable`` says when the layout breaks the reuse (node
boundaries that cut tensor- or data-parallel groups unevenly, fewer than four layers, a ZeRO
split dim that differs at the real ``dp``) and the search then calls ``estimate`` itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from mpipar.compile.plan import PlanMesh, PlanReshard, PlanStep, process_mesh
from mpipar.parallel import ShardingStage1
from mpipar.placement import Replicate, parse_placements
from mpipar.spec import DistSpec
from simulator.cost import HardwareProfile, Link, PipelineCost, collective_time
from simulator.estimate import (
    UPDATE_FLOPS,
    _overlapped,
    layers_per_stage,
    update_bytes,
    update_cost,
)
from simulator.fast_pipeline import PipelineTimes, compile_schedule, lane_flight_events, peak_in_flight
from simulator.op_cost import PlanCosts, _local_shapes, op_family
from simulator.step_trace import FIRST, LAST, SETUP, GPTShape, GPTStrategy, Part, StepTrace, trace_gpt_step

DP = "dp"
TRACED_LAYERS = 4
"""Two stages of two layers: a stage's interior layer and its last one, on both sides of a hand-off."""
INTERIOR = (Part("layer", 0), Part("layer", 2))
LAST_OF_STAGE = (Part("layer", 1), Part("layer", 3))
HANDOFF = Part("handoff", 2)


def _most(value: float | dict[int, float]) -> float:
    if isinstance(value, dict):
        return max(value.values(), default=0.0)
    return float(value)


def _add(into: dict[tuple[Part, str], float], part: Part, bucket: str, seconds: float) -> None:
    into[(part, bucket)] = into.get((part, bucket), 0.0) + seconds


def _context_reshard(res: PlanReshard, step: StepTrace, param_tensors: set[int]) -> bool:
    """Whether a reshard serves parameters' data parallelism: a gradient reduction, an optimizer
    reshard, a gather of a (ZeRO-3) parameter, or any collective over ``dp``."""
    return (
        res.index in step.grad_sync
        or res.phase == "optimizer"
        or res.tensor in param_tensors
        or any(DP in s.axes for s in res.steps)
    )


class _Costs(PlanCosts):
    """``PlanCosts`` whose cross-mesh transfers run on a given link class (the hand-off's real one)."""

    transfer_link: Link | None = None

    def _transfer_time(self, step: PlanStep, rank: int) -> float:
        if self.transfer_link is None:
            return super()._transfer_time(step, rank)
        link = self.transfer_link
        sent = sum(collective_time("send", n, 2, link) for s, d, n in step.pieces if s == rank and s != d)
        received = sum(collective_time("send", n, 2, link) for s, d, n in step.pieces if d == rank and s != d)
        return max(sent, received)


def _bucket(res: PlanReshard, step: StepTrace, hw: HardwareProfile, strategy: GPTStrategy) -> str:
    if res.index in step.grad_sync:
        return "sync"
    if hw.gpu_model and _overlapped(res, strategy):
        return "overlap"
    return res.phase


@dataclass(frozen=True)
class Overheads:
    """``estimate``'s optional pricing knobs (the search uses the defaults)."""

    memory_bandwidth: float | None = None
    vector_flops: float | None = None
    op_overhead: float | None = None
    reshard_overhead: float | None = None
    update_overhead: float | None = None

    def costs(self, plan: object, hw: HardwareProfile) -> _Costs:
        return _Costs(
            plan,
            hw,
            memory_bandwidth=self.memory_bandwidth,
            vector_flops=self.vector_flops,  # type: ignore[arg-type]
            op_overhead=self.op_overhead,
            reshard_overhead=self.reshard_overhead,
        )


# ---------------------------------------------------------------------- invariant costs
@dataclass
class InvariantCosts:
    """Seconds per (part, bucket) of the dp-invariant work, hand-offs per link class, activations per part."""

    seconds: dict[tuple[Part, str], float]
    handoff: dict[str, dict[str, float]]
    """``{"intra" | "inter": {"forward" | "backward": seconds}}`` of one stage boundary."""
    activations: dict[Part, int]
    trace_seconds: float
    gemm_flops: dict[tuple[Part, str], float]
    """Matmul FLOPs per (part, ``forward`` | ``backward``) on the busiest rank: what no profile can
    run faster than its best GEMM rate (the search's lower bounds)."""


def invariant_costs(step: StepTrace, hw: HardwareProfile, over: Overheads = Overheads()) -> InvariantCosts:
    """The dp-invariant part of ``estimate``'s ledger, from a ``dp = 1`` trace (module docstring)."""
    plan = step.plan
    costs = over.costs(plan, hw)
    params = {t.id for t in plan.tensors if t.kind == "parameter"}
    seconds: dict[tuple[Part, str], float] = {}
    gemm: dict[tuple[Part, str], float] = {}
    for op, part in zip(plan.ops, step.op_parts, strict=True):
        if part == SETUP or op.phase not in ("forward", "backward"):
            continue
        times = costs.op_times(op)
        if op.op == "matmul":
            # One float from op_times: even shards, every rank runs the same GEMM (its FLOPs once,
            # not once per rank of a 128-rank trace).
            ranks = costs.op_ranks(op)
            _add(
                gemm,
                part,
                op.phase,
                max((costs.op_flops(op, r) for r in (ranks if isinstance(times, dict) else ranks[:1])), default=0.0),
            )
        t = _most(times)
        _add(seconds, part, op.phase, t)
        _add(seconds, part, f"{op.phase}/{op_family(op.op)}", t)
        if op.index in step.weight_ops:
            _add(seconds, part, "weight", t)
    handoff: dict[str, dict[str, float]] = {"intra": {}, "inter": {}}
    for res, part in zip(plan.reshards, step.reshard_parts, strict=True):
        if part == SETUP or _context_reshard(res, step, params):
            continue
        bucket = _bucket(res, step, hw, step.strategy)
        if part.kind == "handoff":
            if bucket in ("forward", "backward"):
                for name, link in (("intra", hw.intra_node), ("inter", hw.inter_node)):
                    costs.transfer_link = link
                    handoff[name][bucket] = handoff[name].get(bucket, 0.0) + _most(costs.reshard_times(res))
                costs.transfer_link = None
            continue
        t = _most(costs.reshard_times(res))
        _add(seconds, part, bucket, t)
        if bucket in ("forward", "backward"):
            _add(seconds, part, f"{bucket}/comm", t)
    activations = {p: max(v.values(), default=0) for p, v in step.activations.items()}
    return InvariantCosts(seconds, handoff, activations, step.seconds, gemm)


# ---------------------------------------------------------------------- data-parallel costs
@dataclass
class PricedContext:
    seconds: dict[tuple[Part, str], float]
    state: dict[Part, dict[str, int]]


class ContextCosts:
    """The data-parallel part of the ledger from a ``dp = 2`` trace, re-priced at any ``dp`` (``at``)."""

    def __init__(self, step: StepTrace, hw: HardwareProfile, over: Overheads = Overheads()) -> None:
        self.step = step
        self.hw = hw
        self.over = over
        self._cache: dict[int, PricedContext | None] = {}

    def at(self, dp: int) -> PricedContext | None:
        """Priced on ``dp x tp`` stage meshes; ``None`` when a ZeRO split dim would differ there."""
        if dp not in self._cache:
            self._cache[dp] = self._price(dp)
        return self._cache[dp]

    def _price(self, dp: int) -> PricedContext | None:
        step, hw, over = self.step, self.hw, self.over
        traced_dp = step.strategy.dp
        if (traced_dp == 1) != (dp == 1):
            raise ValueError(f"a trace with dp={traced_dp} prices dp=1 only with itself; got dp={dp}")
        plan = step.plan
        tp = step.strategy.tp
        block = {ranks: k for k, ranks in enumerate(step.stage_ranks)}
        real: dict[tuple[int, ...], PlanMesh] = {}
        meshes = []
        for m in plan.meshes:
            if m.dim_names != (DP, "tp") or m.shape != (traced_dp, tp) or m.process_ids not in block:
                raise ValueError(
                    f"the GPT trace has an unexpected mesh {m}; the fast estimate knows (dp, tp) stage meshes"
                )
            k = block[m.process_ids]
            ids = tuple(range(k * dp * tp, (k + 1) * dp * tp))
            real[m.process_ids] = PlanMesh(m.id, (dp, tp), ids, m.dim_names)
            meshes.append(real[m.process_ids])
        if dp != traced_dp and not _zero_splits_agree(step, real):
            return None
        costs = over.costs(replace(plan, meshes=meshes), hw)
        params = {t.id for t in plan.tensors if t.kind == "parameter"}
        seconds: dict[tuple[Part, str], float] = {}
        for op, part in zip(plan.ops, step.op_parts, strict=True):
            if part == SETUP or op.phase != "optimizer":
                continue
            _add(seconds, part, "optimizer", _most(costs.op_times(op)))
        for res, part in zip(plan.reshards, step.reshard_parts, strict=True):
            if part == SETUP or not _context_reshard(res, step, params):
                continue
            bucket = _bucket(res, step, hw, step.strategy)
            t = _most(costs.reshard_times(res))
            _add(seconds, part, bucket, t)
            if bucket in ("forward", "backward"):
                _add(seconds, part, f"{bucket}/comm", t)
        # Updates and model state, per rank summed over a part's parameters (estimate's order).
        strategy = step.strategy
        per_update = update_cost(hw, over.op_overhead, over.update_overhead)
        bandwidth = over.memory_bandwidth
        if bandwidth is None and hw.gpu_model:
            bandwidth = hw.memory_Bps
        update_dtype = "float32" if strategy.mixed_precision else strategy.dtype
        # Per global rank (the two stage meshes are contiguous blocks of ``dp x tp`` ids) as
        # arrays: a 1024-rank layout sums hundreds of parameters over every rank.
        world = 2 * dp * tp
        elements: dict[Part, np.ndarray] = {}
        holds: dict[Part, np.ndarray] = {}
        counts: dict[Part, int] = {}
        state: dict[Part, dict[str, np.ndarray]] = {}
        for rec in step.state_records:
            mesh = real[rec.mesh]
            block_of = slice(mesh.process_ids[0], mesh.process_ids[-1] + 1)
            counts[rec.part] = counts.get(rec.part, 0) + 1
            if rec.part not in elements:
                elements[rec.part] = np.zeros(world, dtype=np.int64)
                holds[rec.part] = np.zeros(world, dtype=bool)
            el, held = elements[rec.part], holds[rec.part]
            if rec.update is None:
                el += math.prod(rec.shape)
                held[:] = True
            else:
                el[block_of] += _local_sizes(rec.shape, mesh, rec.update)
                held[block_of] = True
            cats = state.setdefault(rec.part, {})
            for cat, size, pls in rec.entries:
                if cat not in cats:
                    cats[cat] = np.zeros(world, dtype=np.int64)
                cats[cat][block_of] += _local_sizes(rec.shape, mesh, pls) * size
        for part, per_rank in elements.items():
            most = 0.0
            for n in np.unique(per_rank[holds[part]]).tolist():
                flops = n * UPDATE_FLOPS[strategy.optimizer]
                t = costs.vector_time(flops, update_bytes(step, part, n), update_dtype)
                if bandwidth is not None:
                    t = max(t, n * step.update_bytes_per_element / bandwidth)
                most = max(most, t + per_update * counts.get(part, 0))
            _add(seconds, part, "optimizer", most)
        return PricedContext(seconds, {p: {c: int(v.max()) for c, v in cats.items()} for p, cats in state.items()})


@functools.lru_cache(maxsize=4096)
def _local_sizes(shape: tuple[int, ...], mesh: PlanMesh, placements: str) -> np.ndarray:
    """Elements of ``shape`` laid out as ``placements`` on each rank of ``mesh``, in ``process_ids`` order."""
    sizes = np.array([math.prod(s) for s in _local_shapes(shape, mesh, placements).values()], dtype=np.int64)
    sizes.flags.writeable = False  # shared by every caller through the cache
    return sizes


def _zero_splits_agree(step: StepTrace, real: dict[tuple[int, ...], PlanMesh]) -> bool:
    """Whether ZeRO splits every parameter along the same dim on the real ``dp`` as on the traced one
    (the split dim is the longest local dim at least ``dp`` long: a short one may drop out)."""
    if step.strategy.zero == 0:
        return True
    stage = ShardingStage1(DP)
    for rec in step.state_records:
        if rec.update is None:
            continue
        pls = list(parse_placements(rec.entries[0][2]))
        pls[0] = Replicate()
        m = real[rec.mesh]
        mesh = process_mesh(m)
        base = DistSpec(rec.shape, mesh, pls)
        spec = stage.layout(None, base)  # type: ignore[arg-type]
        # No split: the update runs in the parameter's own layout (``Optimizer.layout_of``).
        if (spec if spec is not None else base).placements_str != rec.update:
            return False
    return True


# ---------------------------------------------------------------------- applicability
def applicable(shape: GPTShape, strategy: GPTStrategy, hw: HardwareProfile) -> str:
    """Why the fast path cannot price ``strategy`` ("" when it can)."""
    if shape.layers < TRACED_LAYERS:
        return f"the model has {shape.layers} layers; the fast path traces {TRACED_LAYERS}"
    counts = layer_counts(shape.layers, strategy.pp, strategy.chunks)
    if min(counts) < 1:
        return "a pipeline stage has no layer"
    n = hw.devices_per_node
    if n is None:
        return ""
    block = strategy.dp * strategy.tp
    for size, what in ((strategy.tp, "tp"), (block, "dp x tp")):
        if n % size and size % n:
            return f"{what} groups of {size} ranks cut {n}-device nodes unevenly"
    return ""


@functools.lru_cache(maxsize=4096)
def layer_counts(layers: int, pp: int, chunks: int) -> list[int]:
    """``layers_per_stage``: the model's rule places layers by stage count alone, so a one-rank-wide
    mesh of the same pipeline answers for any ``dp x tp``."""
    probe = GPTStrategy(1, 1, pp, schedule="Interleaved1F1B" if chunks > 1 else "1F1B", chunks=chunks)
    return layers_per_stage(GPTShape(layers, 1, 1, 1, 1), probe)


# ---------------------------------------------------------------------- pipeline
def _simulate(strategy: GPTStrategy, micro: int, cost: PipelineCost, act: tuple[int, ...]) -> PipelineTimes:
    # The schedule compiled once per shape (``simulator.fast_pipeline``): candidates that differ
    # in costs only replay it.
    return compile_schedule(
        strategy.schedule, strategy.num_stages, micro, strategy.chunks, cost.blocking_transfers
    ).run(cost, act)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-30)


def pipeline(strategy: GPTStrategy, cost: PipelineCost, act: tuple[int, ...]) -> tuple[PipelineTimes, float]:
    """The schedule's lane ends, makespan and activations in flight (and its bubble fraction).

    A long step is extrapolated: past a few rounds every quantity grows by the same amount per
    round of micro-batches (one micro-batch, or ``pp`` of them for Interleaved1F1B), which is
    checked on three simulated points before it is used; otherwise the step is simulated whole."""
    m = strategy.micro_batches
    period = strategy.pp if strategy.chunks > 1 else 1
    base = strategy.num_stages + period
    base += (m - base) % period
    if m <= base + 2 * period:
        pipe = _simulate(strategy, m, cost, act)
    else:
        pts = [_simulate(strategy, base + i * period, cost, act) for i in range(3)]
        lanes = len(pts[0].ends)

        def series(i: int) -> list[float]:
            p = pts[i]
            return [*p.ends, p.makespan, p.busy, *p.in_flight]

        s0, s1, s2 = series(0), series(1), series(2)
        if all(_close(b - a, c - b) for a, b, c in zip(s0, s1, s2, strict=True)):
            rounds = (m - base) // period
            out = [a + rounds * (b - a) for a, b in zip(s0, s1, strict=True)]
            pipe = PipelineTimes(
                tuple(out[:lanes]), out[lanes], out[lanes + 1], tuple(round(x) for x in out[lanes + 2 :])
            )
        else:
            pipe = _simulate(strategy, m, cost, act)
    lanes = len(pipe.ends)
    bubble = 1.0 - pipe.busy / (lanes * pipe.makespan) if pipe.makespan > 0 else 0.0
    return pipe, bubble


# ---------------------------------------------------------------------- assembly
@dataclass(frozen=True)
class FastEstimate:
    """``estimate``'s headline numbers for one strategy."""

    step_time_s: float
    peak_bytes: int
    """The largest per-rank peak (``max(Estimate.peak_bytes_per_rank.values())``)."""
    bubble_fraction: float
    pipeline_s: float
    tail_s: tuple[float, ...]


def stage_parts(strategy: GPTStrategy, counts: list[int]) -> list[list[tuple[Part, float]]]:
    """Per real stage, the traced parts that make it and how many real layers each stands for."""
    n = len(counts)
    out = []
    for s, layers in enumerate(counts):
        parts: list[tuple[Part, float]] = []
        if s == 0:
            parts.append((FIRST, 1))
        if layers > 1:
            # An interior layer fed by the embedding or by a hand-off: the traced twin on that side.
            parts.append((INTERIOR[0 if s == 0 else 1], layers - 1))
        # The model's last layer feeds the final norm and head (traced layer 3); any other
        # stage's last layer feeds a hand-off (traced layer 1).
        parts.append((LAST_OF_STAGE[1 if s == n - 1 else 0], 1))
        if s == n - 1:
            parts.append((LAST, 1))
        out.append(parts)
    return out


def assemble(
    shape: GPTShape,
    strategy: GPTStrategy,
    hw: HardwareProfile,
    inv: InvariantCosts,
    ctx: PricedContext,
) -> FastEstimate:
    """``estimate``'s pipeline, tails and peaks from the two halves of the ledger (module docstring)."""
    counts = layer_counts(shape.layers, strategy.pp, strategy.chunks)
    parts = stage_parts(strategy, counts)

    def value(part: Part, bucket: str) -> float:
        return inv.seconds.get((part, bucket), 0.0) + ctx.seconds.get((part, bucket), 0.0)

    def stage_sum(s: int, bucket: str) -> float:
        return sum(k * value(p, bucket) for p, k in parts[s])

    per_micro = hw.prices_eager_runtime  # estimate's stage_times: each backward reduces its gradients
    fwd, b_in, b_w = [], [], []
    for s in range(len(parts)):
        sync = stage_sum(s, "sync") if per_micro else 0.0
        w = stage_sum(s, "weight") + sync
        b = stage_sum(s, "backward") + sync + max(0.0, stage_sum(s, "overlap") - stage_sum(s, "weight"))
        fwd.append(stage_sum(s, "forward"))
        b_w.append(min(w, b))
        b_in.append(max(b - w, 0.0))
    block = strategy.dp * strategy.tp
    send_f, send_b = [], []
    for s in range(1, len(parts)):
        a, b = (s - 1) % strategy.pp, s % strategy.pp
        link = "intra" if hw.link([a * block, b * block]) is hw.intra_node else "inter"
        send_f.append(inv.handoff[link].get("forward", 0.0))
        send_b.append(inv.handoff[link].get("backward", 0.0))
    act = tuple(round(sum(k * inv.activations.get(p, 0) for p, k in parts[s])) for s in range(len(parts)))
    state = [sum(round(k * n) for p, k in parts[s] for n in ctx.state.get(p, {}).values()) for s in range(len(parts))]
    cost = PipelineCost(
        tuple(fwd), tuple(b_in), tuple(b_w), tuple(send_f), tuple(send_b), "s", blocking_transfers=per_micro
    )
    pipe, bubble = pipeline(strategy, cost, act)
    lanes = len(pipe.ends)
    stages_of = [[s for s in range(len(parts)) if s % strategy.pp == k] for k in range(lanes)]
    tails = tuple(
        sum((0.0 if per_micro else stage_sum(s, "sync")) + stage_sum(s, "optimizer") for s in stages_of[k])
        for k in range(lanes)
    )
    step_time = max(e + t for e, t in zip(pipe.ends, tails, strict=True))
    peak = max(sum(state[s] for s in stages_of[k]) + pipe.in_flight[k] for k in range(lanes))
    return FastEstimate(step_time, peak, bubble, pipe.makespan, tails)


# ---------------------------------------------------------------------- traces, cached
def _trace_key(shape: GPTShape, strategy: GPTStrategy, dp: int, zero: int) -> tuple[object, ...]:
    """What a cached trace of ``strategy``'s layer (and the costs read off it) depends on."""
    return (
        shape,
        strategy.tp,
        strategy.sequence_parallel,
        strategy.recompute,
        zero,
        dp,
        strategy.mixed_precision,
        strategy.optimizer,
        strategy.grad_clip,
    )


class TraceCache:
    """Traces shared across strategies, one per (micro-batch size, tp, sequence parallel, recompute,
    ZeRO, dp 1 or 2), two stages of two layers each. The invariant costs come from the ZeRO-0
    trace, the data-parallel costs from the one with the strategy's ZeRO stage (``dp = 1``
    strategies use the first for both; ``TraceCache.invariant`` says why two). The micro-batch size stays in every key: the rules pick an op's layouts by
    the bytes they move, so a larger batch can change how the head and loss are laid out, and
    with them the layout their gradients are reduced from."""

    def __init__(self, hw: HardwareProfile, over: Overheads = Overheads()) -> None:
        self.hw = hw
        self.over = over
        self._steps: dict[tuple[object, ...], StepTrace] = {}
        self._inv: dict[tuple[object, ...], InvariantCosts] = {}
        self._ctx: dict[tuple[object, ...], ContextCosts] = {}
        self.trace_seconds = 0.0

    @property
    def traces(self) -> int:
        return len(self._steps)

    def trace(self, shape: GPTShape, strategy: GPTStrategy, dp: int, zero: int) -> StepTrace:
        """The ``dp``-wide (1 or 2), two-stage trace of ``strategy``'s layer under ZeRO ``zero``."""
        key = _trace_key(shape, strategy, dp, zero)
        if key not in self._steps:
            traced = GPTStrategy(
                dp,
                strategy.tp,
                2,
                strategy.sequence_parallel,
                strategy.recompute,
                zero,
                strategy.mixed_precision,
                strategy.optimizer,
                1,
                "1F1B",
                1,
                strategy.grad_clip,
            )
            step = trace_gpt_step(shape, traced, TRACED_LAYERS)
            self._steps[key] = step
            self.trace_seconds += step.seconds
        return self._steps[key]

    def invariant(self, shape: GPTShape, strategy: GPTStrategy) -> InvariantCosts:
        """From the ZeRO-0 trace, ``dp = 2`` for any ``dp > 1``: the rules lay the head and loss out
        by global sizes, so one data-parallel replica can pick other layouts than two (two and
        more agree on the shapes the tests cover)."""
        dp = 1 if strategy.dp == 1 else 2
        key = _trace_key(shape, strategy, dp, 0)
        if key not in self._inv:
            self._inv[key] = invariant_costs(self.trace(shape, strategy, dp, 0), self.hw, self.over)
        return self._inv[key]

    def context(self, shape: GPTShape, strategy: GPTStrategy) -> PricedContext | None:
        dp, zero = (1, 0) if strategy.dp == 1 else (2, strategy.zero)
        key = _trace_key(shape, strategy, dp, zero)
        if key not in self._ctx:
            self._ctx[key] = ContextCosts(self.trace(shape, strategy, dp, zero), self.hw, self.over)
        return self._ctx[key].at(strategy.dp)

    def estimate(self, shape: GPTShape, strategy: GPTStrategy) -> FastEstimate | None:
        """The fast estimate, or ``None`` when it does not apply (``applicable``)."""
        if applicable(shape, strategy, self.hw):
            return None
        ctx = self.context(shape, strategy)
        if ctx is None:
            return None
        return assemble(shape, strategy, self.hw, self.invariant(shape, strategy), ctx)


def fast_estimate(
    shape: GPTShape, strategy: GPTStrategy, profile: HardwareProfile, cache: TraceCache | None = None
) -> FastEstimate | None:
    """``estimate(shape, strategy, profile)``'s step time and peak memory through shared traces."""
    return (cache if cache is not None else TraceCache(profile)).estimate(shape, strategy)


def lower_bound_stage_times(
    inv: InvariantCosts, strategy: GPTStrategy, counts: list[int]
) -> list[tuple[float, float, float]]:
    """Per stage (forward, backward input, backward weight) from the invariant costs alone: the
    data-parallel half only adds to them, so a schedule built on these is never slower."""
    out = []
    for parts in stage_parts(strategy, counts):

        def s(bucket: str, parts: Iterable[tuple[Part, float]] = parts) -> float:
            return sum(k * inv.seconds.get((p, bucket), 0.0) for p, k in parts)

        w = s("weight")
        b = s("backward") + max(0.0, s("overlap") - w)
        out.append((s("forward"), max(b - w, 0.0), min(w, b)))
    return out


def in_flight_lower_bound(strategy: GPTStrategy, act: tuple[int, ...]) -> tuple[int, ...] | None:
    """Per lane, activation bytes in flight that ``pipeline`` can report no fewer of, whatever the
    costs: the whole step's walk when ``pipeline`` simulates it whole; when it may extrapolate,
    the smaller of the extrapolation and the walk (the costs decide which it takes). ``None``
    when the step is too long to walk (``fast_pipeline.LONGEST_WALK``)."""
    m, stages, chunks = strategy.micro_batches, strategy.num_stages, strategy.chunks
    whole = lane_flight_events(strategy.schedule, stages, m, chunks)
    if whole is None:
        return None
    full = peak_in_flight(whole, act)
    period = strategy.pp if chunks > 1 else 1
    base = stages + period
    base += (m - base) % period
    if m <= base + 2 * period:
        return full
    pts = []
    for i in range(3):
        events = lane_flight_events(strategy.schedule, stages, base + i * period, chunks)
        assert events is not None  # shorter than ``whole``
        pts.append(peak_in_flight(events, act))
    s0, s1, s2 = pts
    if not all(_close(b - a, c - b) for a, b, c in zip(s0, s1, s2, strict=True)):
        return full  # never extrapolated: pipeline simulates the whole step
    rounds = (m - base) // period
    return tuple(min(f, round(a + rounds * (b - a))) for f, a, b in zip(full, s0, s1, strict=True))


def peak_lower_bound(strategy: GPTStrategy, counts: list[int], inv: InvariantCosts, state_per_layer: float) -> float:
    """``assemble``'s peak can be no lower: per lane, ``state_per_layer`` (a lower bound of one
    layer's model state on a rank) per layer it holds plus ``in_flight_lower_bound`` of the
    exact per-stage activations; 0 when the step is too long to walk."""
    parts = stage_parts(strategy, counts)
    act = tuple(round(sum(k * inv.activations.get(p, 0) for p, k in parts[s])) for s in range(len(parts)))
    flight = in_flight_lower_bound(strategy, act)
    if flight is None:
        return 0.0
    return max(
        state_per_layer * sum(n for s, n in enumerate(counts) if s % strategy.pp == k) + f for k, f in enumerate(flight)
    )
