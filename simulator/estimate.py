"""``python -m simulator estimate``: memory and step time of GPT training, from a shape-only trace.

(``--model NAME`` and the family flags -- ``--kv-heads``, ``--ffn-hidden``, ``--mlp``, ``--norm``,
``--untied``, ``--attention``, ``cp=`` in ``--mesh`` -- price any GPT/Llama shape with the
closed-form family model instead: ``simulator.family_cli``.)

    python -m simulator estimate --params 175e9 --mesh dp=8,tp=8,pp=16 --sequence-parallel \\
        --recompute selective --zero 1 --mixed-precision --micro-batches 64 --schedule 1F1B
    python -m simulator estimate --layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 50257 \\
        --micro-batch-size 1 --mesh tp=8 --sequence-parallel --mixed-precision --json

Nothing here is a formula for a model's memory or time: the numbers are read off one traced
training step (``simulator.step_trace``: ``mpipar.models.gpt.GPT`` laid out by
``GPTParallel``, run under ``ShapeOnlyBackend`` with two transformer layers per pipeline stage,
every event labelled by the layer or part it serves) and scaled by the layers each stage holds:

* **activations per layer**: the bytes the traced layer's tape nodes keep for backward, on
  each rank (16-bit tensors under ``--mixed-precision``, dropout masks as one-byte bools,
  sequence-parallel gathers kept as their shard, recomputed regions as their inputs);
* **model state per rank**: the parameters and gradients in their layouts, and the
  optimizer's states as ``step()`` created them (ZeRO split; float32 moments and master
  weights under mixed precision, ``multi_precision=True``);
* **step time**: each op's time on each rank from its FLOPs on the local shards
  (``simulator.op_cost``: matmul ``2mnk``, a few FLOPs per element elsewhere; optionally a
  memory-bandwidth roofline and a per-op overhead), each reshard's collectives and transfers
  from ``HardwareProfile.collective_time``/``p2p_time``; per stage the forward ``F``, the
  backward split into input-gradient ``B`` and weight-gradient ``W`` (the backward twins of
  the forward matmuls with a weight operand), the pipeline hand-offs as sends; then
  ``simulate_schedule`` runs the schedule and each pipeline rank adds, once per step, its
  gradient reduction (every reshard that brings a parameter's gradient to its layout: data
  parallel all-reduce, ZeRO reduce-scatter, a Partial weight gradient's reduction) and
  optimizer step (update FLOPs or bytes, the ZeRO all-gather), as a runtime accumulating
  micro-batches locally does (mpipar's eager loop reduces after every micro-batch instead).
  Nothing overlaps communication with compute except what the schedule itself overlaps
  (transfers between stages) and, with ``--overlap-grad-reduce`` (``dist.overlap_grad_reduction``),
  the gradient reduction: each part's reduction starts when the last micro-batch's backward
  is done with it (parts in the reverse of their forward order, one reduction at a time), and
  only what runs past the end of backward is paid (``exposed_grad_sync``).
* **not modelled**: buffers (the causal mask), communication buffers, fragmentation, the
  norm's collective in gradient clipping, and the host-side SPMD dispatch of other stages'
  ops that mpipar's eager mode performs on every rank.
* **peak memory per rank** = model state + the largest sum of activations its schedule holds
  at once (the micro-batches in flight on its stage(s), walked along its action list).

``--offload`` (``dist.offload_optimizer(opt, master_weight=True)``): the optimizer's states
and master weights live in host memory; each rank's device peak drops by its
``optimizer_state`` bytes and the step adds the copy there and back over the profile's
``host_link_Bps`` (``--host-link-bandwidth`` overrides it). Reported apart, under ``offload``.

Output: JSON (``--json``) with ``activation_bytes_per_layer``, ``model_state_bytes_per_rank``,
``peak_bytes_per_rank`` (one entry per rank), ``step_time_s``, per-stage details and what
each layer keeps (``layer_activations``); otherwise a summary table. ``--plan PATH`` writes the
traced plan (``mpipar.plan`` JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from mpipar import cliargs
from mpipar.debug.timeline import Timeline
from mpipar.models.gpt import GPTParallel
from mpipar.pipeline import Schedule, build_schedule
from mpipar.pipeline.actions import final_backward_kind
from mpipar.untrusted import printable
from simulator.cost import HardwareProfile, PipelineCost, load_profile
from simulator.family_cli import add_family_arguments, resolve_gpt_defaults, run_estimate, wants_family
from simulator.op_cost import PlanCosts, op_family
from simulator.schedule_sim import simulate_schedule
from simulator.step_trace import SETUP, GPTShape, GPTStrategy, KeptTensor, Part, StepTrace, build_meshes, trace_gpt_step

FORMAT = "mpipar.estimate"
VERSION = 1
UPDATE_FLOPS = {"adamw": 14.0, "momentum": 4.0}
"""FLOPs per element of one optimizer update (AdamW: decay, two moments, bias-corrected step)."""


@dataclass
class StageEstimate:
    stage: int
    ranks: tuple[int, ...]
    layers: int
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    send_forward_s: float
    """Hand-off of one micro-batch's activation to the next stage (0 for the last)."""
    activation_bytes_per_microbatch: int
    """On the busiest rank of the stage: everything the stage keeps for one micro-batch."""
    peak_in_flight: int
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    """Per micro-batch on the busiest rank: ``forward/gemm``, ``backward/norm``, ``forward/comm``,
    ``backward/comm_overlapped`` (hidden behind weight-gradient GEMMs), ... in milliseconds."""


@dataclass
class Estimate:
    shape: GPTShape
    strategy: GPTStrategy
    hardware: str
    activation_bytes_per_layer: int
    layer_activations: list[KeptTensor]
    model_state_bytes_per_rank: dict[int, int]
    model_state_by_category: dict[str, dict[int, int]]
    peak_bytes_per_rank: dict[int, int]
    step_time_s: float
    pipeline_s: float
    tail_s: list[float]
    """Per pipeline rank: gradient reduction and optimizer step after its last backward."""
    bubble_fraction: float
    stages: list[StageEstimate]
    trace_seconds: float
    layers_traced: int
    ops: int
    reshards: int
    peak_flops_per_device: float = 0.0
    """The profile's dense peak for the plan's compute dtype (what MFU and HFU divide by)."""
    grad_sync_exposed_s: list[float] | None = None
    """Per pipeline rank, with ``overlap_grad_reduce``: the gradient reduction not hidden behind
    the last backward (the rest of ``tail_s`` is the optimizer step); None without overlap."""

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one step (fwd + bwd, no recompute): Narayanan et al. 2021, Eq. 3 with
        ``l`` layers, ``h`` hidden, ``s`` sequence, ``V`` vocabulary, ``B`` sequences per step:
        ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (Eq. 3's 96 counts full recompute; 72 = 3/4 of it)."""
        sh = self.shape
        b = self.tokens_per_step / sh.seq
        n, h, s, v = sh.layers, sh.hidden, sh.seq, sh.vocab
        return 72.0 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))

    @property
    def hardware_flops(self) -> float:
        """Model FLOPs plus what recomputation adds: one more forward of every layer under full
        recompute (Eq. 3's 96), the attention core ``4 B s^2 h`` per layer under selective
        (Korthikanti et al. 2022, section 5)."""
        sh = self.shape
        b = self.tokens_per_step / sh.seq
        n, h, s = sh.layers, sh.hidden, sh.seq
        if self.strategy.recompute == "full":
            return self.model_flops + 24.0 * b * s * n * h * h * (1 + s / (6 * h))
        if self.strategy.recompute == "selective":
            return self.model_flops + 4.0 * b * s * s * h * n
        return self.model_flops

    def utilization(self, flops: float) -> float | None:
        denom = self.step_time_s * self.peak_flops_per_device * self.world_size
        return flops / denom if denom > 0 else None

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def tokens_per_step(self) -> int:
        s = self.strategy
        return self.shape.micro_batch_size * s.dp * s.micro_batches * self.shape.seq

    def to_dict(self) -> dict[str, Any]:
        ranks = sorted(self.peak_bytes_per_rank)
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {**asdict(self.shape), "parameters": self.shape.parameters},
            "strategy": asdict(self.strategy),
            "hardware": self.hardware,
            "world_size": self.world_size,
            "tokens_per_step": self.tokens_per_step,
            "activation_bytes_per_layer": self.activation_bytes_per_layer,
            "layer_activations": [asdict(k) for k in self.layer_activations],
            "model_state_bytes_per_rank": [self.model_state_bytes_per_rank[r] for r in ranks],
            "model_state_by_category": {
                c: [v.get(r, 0) for r in ranks] for c, v in self.model_state_by_category.items()
            },
            "peak_bytes_per_rank": [self.peak_bytes_per_rank[r] for r in ranks],
            "step_time_s": self.step_time_s,
            "model_flops_per_step": self.model_flops,
            "hardware_flops_per_step": self.hardware_flops,
            "mfu": self.utilization(self.model_flops),
            "hfu": self.utilization(self.hardware_flops),
            "tokens_per_s": self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else None,
            "pipeline": {
                "schedule": self.strategy.schedule,
                "num_stages": self.strategy.num_stages,
                "micro_batches": self.strategy.micro_batches,
                "pipeline_s": self.pipeline_s,
                "bubble_fraction": self.bubble_fraction,
                "tail_s": self.tail_s,
                **({} if self.grad_sync_exposed_s is None else {"grad_sync_exposed_s": self.grad_sync_exposed_s}),
            },
            "stages": [asdict(s) for s in self.stages],
            "trace": {
                "layers_traced": self.layers_traced,
                "ops": self.ops,
                "reshards": self.reshards,
                "seconds": self.trace_seconds,
            },
        }

    def summary(self) -> str:
        sh, st = self.shape, self.strategy
        gib = 2.0**30
        opts = [f"dp {st.dp} x tp {st.tp} x pp {st.pp} ({self.world_size} ranks)"]
        if st.chunks > 1:
            opts.append(f"{st.chunks} chunks per pipeline rank")
        if st.sequence_parallel:
            opts.append("sequence parallel")
        if st.recompute != "none":
            opts.append(f"recompute {st.recompute}")
        if st.zero:
            opts.append(f"ZeRO-{st.zero}")
        opts.append("mixed precision (float16, float32 masters)" if st.mixed_precision else "float32")
        opts.append({"adamw": "AdamW", "momentum": "Momentum"}[st.optimizer])
        lines = [
            f"GPT {sh.parameters / 1e9:.2f}B parameters: {sh.layers} layers, hidden {sh.hidden}, {sh.heads} heads, "
            f"seq {sh.seq}, vocab {sh.vocab}",
            f"batch: {sh.micro_batch_size} x dp {st.dp} x {st.micro_batches} micro-batches = "
            f"{self.tokens_per_step // sh.seq} sequences per step",
            "strategy: " + ", ".join(opts) + f"; {st.schedule}",
            f"hardware: {self.hardware}",
            f"activations per layer (one micro-batch, per rank): {self.activation_bytes_per_layer / 2**20:.1f} MiB",
            "",
            f"{'stage':>5} {'layers':>6} {'state GiB':>9} {'act/mb GiB':>10} {'in flight':>9} {'peak GiB':>8} "
            f"{'F ms':>9} {'B ms':>9} {'W ms':>9}",
        ]
        for s in self.stages:
            state = max(self.model_state_bytes_per_rank[r] for r in s.ranks)
            peak = max(self.peak_bytes_per_rank[r] for r in s.ranks)
            lines.append(
                f"{s.stage:>5} {s.layers:>6} {state / gib:>9.2f} {s.activation_bytes_per_microbatch / gib:>10.2f} "
                f"{s.peak_in_flight:>9} {peak / gib:>8.2f} {s.forward_s * 1e3:>9.2f} {s.backward_input_s * 1e3:>9.2f} "
                f"{s.backward_weight_s * 1e3:>9.2f}"
            )
        peak_rank = max(self.peak_bytes_per_rank, key=lambda r: self.peak_bytes_per_rank[r])
        lines += [
            "",
            f"step time {self.step_time_s:.4g} s: pipeline {self.pipeline_s:.4g} s (bubble {self.bubble_fraction:.3f}), "
            f"then gradient reduction + optimizer up to {max(self.tail_s):.4g} s"
            + (
                ""
                if self.grad_sync_exposed_s is None
                else f" (reduction overlapped with backward, {max(self.grad_sync_exposed_s, default=0.0):.4g} s of it exposed)"
            )
            + "; "
            f"{self.tokens_per_step / self.step_time_s:,.0f} tokens/s",
            f"MFU {_pct(self.utilization(self.model_flops))}, HFU {_pct(self.utilization(self.hardware_flops))} "
            f"(model FLOPs {self.model_flops:.4g} per step, with recomputation {self.hardware_flops:.4g}; "
            f"peak {self.peak_flops_per_device / 1e12:.4g} TFLOP/s x {self.world_size} devices)",
            f"peak memory {self.peak_bytes_per_rank[peak_rank] / gib:.2f} GiB (rank {peak_rank}); "
            f"least {min(self.peak_bytes_per_rank.values()) / gib:.2f} GiB",
            f"traced {self.layers_traced} of {self.shape.layers} layers, {self.ops} ops, {self.reshards} reshards in "
            f"{self.trace_seconds:.2f} s",
        ]
        return "\n".join(lines)

    def breakdown(self) -> str:
        """Per stage: milliseconds per micro-batch by op family and communication, and the bubble."""
        keys = sorted({k for s in self.stages for k in s.breakdown_ms})
        head = f"{'stage':>5} " + " ".join(f"{k:>{max(len(k), 8)}}" for k in keys)
        lines = [
            "per stage, one micro-batch, busiest rank, ms (comm_overlapped: hidden behind weight-gradient GEMMs "
            "up to their time)",
            head,
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:>5} " + " ".join(f"{s.breakdown_ms.get(k, 0.0):>{max(len(k), 8)}.3f}" for k in keys)
            )
        lines.append(
            f"pipeline {self.pipeline_s * 1e3:.2f} ms, bubble {self.bubble_fraction:.3f} (1F1B ideal (p-1)/(m+p-1) = "
            f"{_ideal_bubble(self.strategy):.3f}); gradient reduction + optimizer per lane: "
            + ", ".join(f"{t * 1e3:.2f}" for t in self.tail_s)
            + " ms"
        )
        return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _ideal_bubble(st: GPTStrategy) -> float:
    p, m = st.pp, st.micro_batches
    return (p - 1) / (st.chunks * m + p - 1) if p > 1 else 0.0


# ---------------------------------------------------------------------- the estimate
def layers_per_stage(shape: GPTShape, strategy: GPTStrategy) -> list[int]:
    """Real layers on each stage, by the model's own rule (``GPTParallel.stage_of_layer``)."""
    par = GPTParallel(build_meshes(strategy))
    counts = [0] * strategy.num_stages
    for i in range(shape.layers):
        counts[par.stage_of_layer(i, shape.layers)] += 1
    return counts


def update_cost(hw: HardwareProfile, op_overhead: float | None, update_overhead: float | None) -> float:
    """Host seconds per parameter update: ``update_overhead``, else ``op_overhead``, else the profile's."""
    per_update = (
        update_overhead
        if update_overhead is not None
        else op_overhead
        if op_overhead is not None
        else hw.update_overhead_s
    )
    if not per_update >= 0:
        raise ValueError(f"update_overhead must be >= 0 seconds, got {update_overhead!r}")
    return per_update


def update_bytes(step: StepTrace, part: Part, elements: int) -> float:
    """Bytes one parameter's update of ``part`` reads and writes (the size its kernels run at):
    the part's ``elements`` states over its parameters. The optimizer updates them one by one."""
    return elements * step.update_bytes_per_element / max(1, step.update_counts.get(part, 0))


def update_seconds(
    step: StepTrace, costs: PlanCosts, per_update: float, memory_bandwidth: float | None = None
) -> dict[Part, dict[int, float]]:
    """Each part's optimizer updates, seconds per rank: the update's kernels at the elementwise
    rate (at least its states streamed once at ``memory_bandwidth``, where given) and
    ``per_update`` seconds of host time per parameter updated."""
    strategy = step.strategy
    update_dtype = "float32" if strategy.mixed_precision else strategy.dtype
    seconds: dict[Part, dict[int, float]] = {}
    for part, per_rank in step.update_elements.items():
        updates: dict[int, float] = {}
        for r, n in per_rank.items():
            flops = n * UPDATE_FLOPS[strategy.optimizer]
            t = costs.vector_time(flops, update_bytes(step, part, n), update_dtype)
            if memory_bandwidth is not None:
                t = max(t, n * step.update_bytes_per_element / memory_bandwidth)
            updates[r] = t + per_update * step.update_counts.get(part, 0)
        seconds[part] = updates
    return seconds


def estimate(
    shape: GPTShape,
    strategy: GPTStrategy,
    profile: HardwareProfile | str = "h100-nvlink-ib",
    *,
    memory_bandwidth: float | None = None,
    vector_flops: float | None = None,
    op_overhead: float | None = None,
    reshard_overhead: float | None = None,
    update_overhead: float | None = None,
    step: StepTrace | None = None,
    overlap_grad_reduce: bool = False,
) -> Estimate:
    """Trace ``shape`` under ``strategy`` (or reuse ``step``) and price it on ``profile`` (module docstring).

    ``memory_bandwidth``, ``vector_flops`` (FLOP/s of non-matmul ops), ``op_overhead`` (host
    seconds per op), ``reshard_overhead`` (per reshard call; default ``op_overhead``): see
    ``simulator.op_cost``. ``update_overhead``: host seconds per parameter the optimizer
    updates (default ``op_overhead``). All three default to the profile's measured host costs
    (``op_overhead_s``, ``reshard_overhead_s``, ``update_overhead_s``) when ``op_overhead`` is
    None. ``overlap_grad_reduce``: the runtime reduces gradients while backward runs
    (``dist.overlap_grad_reduction``); only the part of the reduction the rest of the last
    backward cannot hide is paid (``exposed_grad_sync``).

    Three steps: ``price_parts`` (every op, reshard and update charged to the part it serves),
    ``pipeline_tails`` (the schedule run over the stages' times, then each pipeline rank's
    reduction and update) and ``memory_per_rank`` (model state plus activations in flight).
    """
    hw = load_profile(profile) if isinstance(profile, str) else profile
    per_update = update_cost(hw, op_overhead, update_overhead)
    step = step if step is not None else trace_gpt_step(shape, strategy)
    costs = PlanCosts(
        step.plan,
        hw,
        memory_bandwidth=memory_bandwidth,
        vector_flops=vector_flops,
        op_overhead=op_overhead,
        reshard_overhead=reshard_overhead,
    )
    if memory_bandwidth is None and hw.gpu_model:
        memory_bandwidth = hw.memory_Bps  # the GPU model: an optimizer update streams its states
    prices = price_parts(step, strategy, costs, hw, per_update, memory_bandwidth, layers_per_stage(shape, strategy))
    per_micro = hw.prices_eager_runtime and not overlap_grad_reduce
    times = stage_times(prices, per_micro)
    schedule = build_schedule(strategy.schedule, step.num_stages, strategy.micro_batches, strategy.chunks)
    timeline = simulate_schedule(
        schedule,
        PipelineCost(
            tuple(times.forward),
            tuple(times.backward_input),
            tuple(times.backward_weight),
            tuple(times.send_forward),
            tuple(times.send_backward),
            "s",
            blocking_transfers=hw.prices_eager_runtime,
        ),
    )
    tails = pipeline_tails(prices, schedule, timeline, overlap_grad_reduce, per_micro)
    memory = memory_per_rank(prices, schedule)
    in_flight = schedule.peak_in_flight()
    stages = [
        StageEstimate(
            stage=s,
            ranks=step.stage_ranks[s],
            layers=prices.layers[s],
            forward_s=times.forward[s],
            backward_input_s=times.backward_input[s],
            backward_weight_s=times.backward_weight[s],
            send_forward_s=times.send_forward[s] if s < step.num_stages - 1 else 0.0,
            activation_bytes_per_microbatch=max(memory.activations[s].values()),
            peak_in_flight=in_flight[s],
            breakdown_ms=prices.busiest_breakdown(s),
        )
        for s in range(step.num_stages)
    ]
    layer0 = step.activations.get(Part("layer", 0), {})
    update_dtype = "float32" if strategy.mixed_precision else strategy.dtype
    return Estimate(
        shape=shape,
        strategy=strategy,
        hardware=hw.name,
        activation_bytes_per_layer=max(layer0.values()) if layer0 else 0,
        layer_activations=step.layer_kept,
        model_state_bytes_per_rank=memory.state_total,
        model_state_by_category=memory.state_by_category,
        peak_bytes_per_rank=memory.peaks,
        step_time_s=max(e + t for e, t in zip(tails.ends, tails.tails, strict=True)),
        pipeline_s=timeline.makespan,
        tail_s=tails.tails,
        bubble_fraction=timeline.bubble_fraction(),
        stages=stages,
        trace_seconds=step.seconds,
        layers_traced=len(step.layer_stage),
        ops=len(step.plan.ops),
        reshards=len(step.plan.reshards),
        peak_flops_per_device=_peak_rate(hw, update_dtype if not strategy.mixed_precision else "float16"),
        grad_sync_exposed_s=tails.exposed if overlap_grad_reduce else None,
    )


# ---------------------------------------------------------------------- stage pricing
@dataclass
class PartPrices:
    """One step's seconds per ``(part, bucket)`` and rank, and the parts each stage runs.

    Buckets: ``forward``, ``backward``, ``weight`` (weight-gradient ops, also in ``backward``),
    ``sync`` (gradient reductions), ``overlap`` (backward collectives Megatron hides behind the
    weight-gradient GEMMs), ``optimizer``, and per op family ``forward/gemm``, ``backward/comm``, ...
    A traced layer stands for ``scale(part)`` real ones.
    """

    step: StepTrace
    layers: list[int]
    """Real layers on each stage."""
    seconds: dict[tuple[Part, str], _Ledger]
    parts_of_stage: dict[int, list[Part]]
    """Each stage's parts, each once, in first-seen order (sums over them add in the same order
    in every process; a set's order of named parts changes with the string hash seed)."""
    traced: list[list[int]]
    """Each stage's traced layers."""

    def scale(self, part: Part) -> float:
        """Real layers a traced one stands for (``step_trace``: the stage's last traced layer is its
        last layer; the others share the rest), 1 for other parts."""
        if part.kind != "layer":
            return 1
        stage = self.step.layer_stage[part.index]
        mine, real = self.traced[stage], self.layers[stage]
        if len(mine) == 1:
            return real
        if part.index == mine[-1]:
            return 1
        rest = real - 1
        return rest // (len(mine) - 1) if rest % (len(mine) - 1) == 0 else rest / (len(mine) - 1)

    def part_seconds(self, part: Part, bucket: str, rank: int) -> float:
        return self.seconds.get((part, bucket), _EMPTY).at(rank)

    def stage_sum(self, stage: int, bucket: str, rank: int) -> float:
        """``bucket``'s seconds on ``rank`` over every real layer and part of ``stage``."""
        return sum(self.scale(p) * self.part_seconds(p, bucket, rank) for p in self.parts_of_stage[stage])

    def busiest_breakdown(self, stage: int) -> dict[str, float]:
        """Milliseconds per op-family bucket on the stage's busiest rank (forward + backward)."""
        family_buckets = sorted({b for (_, b) in self.seconds if "/" in b} | {"overlap"})
        rank = max(
            self.step.stage_ranks[stage],
            key=lambda r: self.stage_sum(stage, "forward", r) + self.stage_sum(stage, "backward", r),
        )
        out = {
            b.replace("overlap", "backward/comm_overlapped"): 1e3 * self.stage_sum(stage, b, rank)
            for b in family_buckets
        }
        return {k: v for k, v in out.items() if v > 0 or k.endswith("comm")}


def price_parts(
    step: StepTrace,
    strategy: GPTStrategy,
    costs: PlanCosts,
    hw: HardwareProfile,
    per_update: float,
    memory_bandwidth: float | None,
    layers: list[int],
) -> PartPrices:
    """Charge every forward, backward and optimizer op, every reshard and every parameter update
    of ``step`` to the part it serves, by bucket, priced by ``costs``."""
    seconds: dict[tuple[Part, str], _Ledger] = {}

    def charge(part: Part, bucket: str, ranks: tuple[int, ...], value: float | dict[int, float]) -> None:
        seconds.setdefault((part, bucket), _Ledger()).add(ranks, value)

    plan = step.plan
    for op, part in zip(plan.ops, step.op_parts, strict=True):
        if part == SETUP or op.phase not in ("forward", "backward", "optimizer"):
            continue
        times = costs.op_times(op)
        charge(part, op.phase, costs.op_ranks(op), times)
        if op.phase != "optimizer":
            charge(part, f"{op.phase}/{op_family(op.op)}", costs.op_ranks(op), times)
        if op.index in step.weight_ops:
            charge(part, "weight", costs.op_ranks(op), times)
    for res, part in zip(plan.reshards, step.reshard_parts, strict=True):
        if part == SETUP:
            continue
        if res.index in step.grad_sync:
            bucket = "sync"
        elif hw.gpu_model and _overlapped(res, strategy):
            bucket = "overlap"
        else:
            bucket = res.phase
        charge(part, bucket, costs.reshard_ranks(res), costs.reshard_times(res))
        if bucket in ("forward", "backward"):
            charge(part, f"{bucket}/comm", costs.reshard_ranks(res), costs.reshard_times(res))
    for part, updates in update_seconds(step, costs, per_update, memory_bandwidth).items():
        charge(part, "optimizer", tuple(updates), updates)

    parts_of_stage: dict[int, list[Part]] = {s: [] for s in range(step.num_stages)}
    priced = [p for p, _ in seconds]
    kept = [p for p in (*step.activations, *step.model_state) if p != SETUP]
    for part in (*priced, *kept):
        if part.kind != "handoff" and part not in parts_of_stage[step.stage_of(part)]:
            parts_of_stage[step.stage_of(part)].append(part)
    traced = [[i for i, st in enumerate(step.layer_stage) if st == s] for s in range(step.num_stages)]
    return PartPrices(step, layers, seconds, parts_of_stage, traced)


@dataclass
class StageTimes:
    """Per stage, one micro-batch on its busiest rank: what ``simulate_schedule`` runs."""

    forward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    send_forward: list[float]
    """The hand-off from stage ``s`` to ``s + 1`` (one fewer than the stages)."""
    send_backward: list[float]


def stage_times(prices: PartPrices, sync_per_microbatch: bool = False) -> StageTimes:
    """Forward ``F``, input-gradient ``B`` and weight-gradient ``W`` seconds per stage, and the
    hand-offs between stages (the busiest rank of each). ``sync_per_microbatch``: every
    micro-batch's weight gradients are reduced in its own backward (``HardwareProfile.
    prices_eager_runtime``), so the stage's gradient reductions are part of ``W`` (and of
    ``B`` when backward is not split)."""
    step = prices.step
    fwd, b_in, b_w = [], [], []
    for s in range(step.num_stages):
        ranks = step.stage_ranks[s]

        def sync(r: int, s: int = s) -> float:
            return prices.stage_sum(s, "sync", r) if sync_per_microbatch else 0.0

        f = max(prices.stage_sum(s, "forward", r) for r in ranks)
        w = max(prices.stage_sum(s, "weight", r) + sync(r) for r in ranks)
        # Megatron's sequence-parallel backward runs its all-gather and reduce-scatter alongside the
        # weight-gradient GEMMs; only what those GEMMs cannot hide is paid.
        b = max(
            prices.stage_sum(s, "backward", r)
            + sync(r)
            + max(0.0, prices.stage_sum(s, "overlap", r) - prices.stage_sum(s, "weight", r))
            for r in ranks
        )
        fwd.append(f)
        b_w.append(min(w, b))
        b_in.append(max(b - w, 0.0))
    send_f = [0.0] * (step.num_stages - 1)
    send_b = [0.0] * (step.num_stages - 1)
    for (part, bucket), ledger in prices.seconds.items():
        if part.kind == "handoff" and bucket in ("forward", "backward"):
            into = step.stage_of(part)  # the hand-off from stage into - 1 to stage into
            (send_f if bucket == "forward" else send_b)[into - 1] += ledger.most()
    return StageTimes(fwd, b_in, b_w, send_f, send_b)


# ---------------------------------------------------------------------- pipeline tails
@dataclass
class PipelineTails:
    """Per pipeline rank (lane): when its last backward ends, and what it runs after."""

    ends: list[float]
    tails: list[float]
    """Gradient reduction and optimizer step after the lane's last backward (its busiest rank)."""
    exposed: list[float]
    """With ``overlap_grad_reduce``: the reduction the last backward did not hide; else empty."""


def pipeline_tails(
    prices: PartPrices,
    schedule: Schedule,
    timeline: Timeline,
    overlap_grad_reduce: bool,
    sync_per_microbatch: bool = False,
) -> PipelineTails:
    """Each lane's end of compute in ``timeline`` and its tail: every reduction and update paid
    after the last backward, or, with ``overlap_grad_reduce``, only the reduction backward
    cannot hide (parts in the order backward reaches them) plus the update; with
    ``sync_per_microbatch`` the reductions ran in each backward (``stage_times``): the update only."""
    step = prices.step
    # Parts in the order backward reaches them: the reverse of the order forward first runs them.
    forward_order: list[Part] = []
    for op, part in zip(step.plan.ops, step.op_parts, strict=True):
        if op.phase == "forward" and part != SETUP and part.kind != "handoff" and part not in forward_order:
            forward_order.append(part)
    out = PipelineTails([], [], [])
    for k in range(schedule.num_ranks):
        stages = schedule.stages_of(k)
        lane_ranks = step.stage_ranks[stages[0]]
        out.ends.append(max((sp.end for sp in timeline.lane(k, "compute")), default=0.0))
        if not overlap_grad_reduce:
            buckets = ("optimizer",) if sync_per_microbatch else ("sync", "optimizer")
            out.tails.append(max(sum(prices.stage_sum(s, b, r) for s in stages for b in buckets) for r in lane_ranks))
            continue
        mine = [p for p in reversed(forward_order) if any(p in prices.parts_of_stage[s] for s in stages)]
        lane_tail, lane_exposed = 0.0, 0.0
        for r in lane_ranks:
            pieces = [
                (prices.scale(p), prices.part_seconds(p, "backward", r), prices.part_seconds(p, "sync", r))
                for p in mine
            ]
            e = exposed_grad_sync(pieces)
            t = e + sum(prices.stage_sum(s, "optimizer", r) for s in stages)
            if t >= lane_tail:
                lane_tail, lane_exposed = t, e
        out.tails.append(lane_tail)
        out.exposed.append(lane_exposed)
    return out


# ---------------------------------------------------------------------- memory
@dataclass
class RankMemory:
    state_by_category: dict[str, dict[int, int]]
    """``parameters``, ``gradients``, ``optimizer_state``: bytes per rank."""
    state_total: dict[int, int]
    activations: list[dict[int, int]]
    """Per stage, bytes per rank one micro-batch keeps."""
    peaks: dict[int, int]
    """Model state plus the most activations the rank's schedule holds at once."""


def memory_per_rank(prices: PartPrices, schedule: Schedule) -> RankMemory:
    """Model state per rank (traced parts scaled to the real layers) and the peak: state plus the
    micro-batches in flight on the rank's stage(s), walked along its action list."""
    step = prices.step
    state_cat: dict[str, dict[int, int]] = {"parameters": {}, "gradients": {}, "optimizer_state": {}}
    for part, cats in step.model_state.items():
        for cat, per_rank in cats.items():
            for r, n in per_rank.items():
                state_cat[cat][r] = state_cat[cat].get(r, 0) + round(prices.scale(part) * n)
    world = sorted({r for ranks in step.stage_ranks for r in ranks})
    state_total = {r: sum(state_cat[c].get(r, 0) for c in state_cat) for r in world}
    act = [
        {
            r: round(sum(prices.scale(p) * step.activations.get(p, {}).get(r, 0) for p in prices.parts_of_stage[s]))
            for r in step.stage_ranks[s]
        }
        for s in range(step.num_stages)
    ]
    peaks: dict[int, int] = {}
    for k in range(schedule.num_ranks):
        stages = schedule.stages_of(k)
        cache: dict[tuple[int, ...], int] = {}
        for r in step.stage_ranks[stages[0]]:
            vec = tuple(act[s].get(r, 0) for s in stages)
            if vec not in cache:
                cache[vec] = _peak_in_flight_bytes(schedule, k, dict(zip(stages, vec, strict=True)))
            peaks[r] = state_total[r] + cache[vec]
    return RankMemory(state_cat, state_total, act, peaks)


def exposed_grad_sync(parts: list[tuple[float, float, float]]) -> float:
    """Seconds of gradient reduction left after the last backward ends, when reductions start
    as soon as their gradients are ready (``overlap_grad_reduce``).

    ``parts``: in the order backward runs them, ``(count, backward_s, sync_s)``: ``count``
    layers alike (a traced layer standing for several), each taking ``backward_s`` of backward
    and then ``sync_s`` of reduction. A reduction starts when its layer's backward is done and
    the previous reduction has finished (one at a time, as buckets do); what runs past the end
    of backward is exposed. A fractional count is spread over its whole layers.
    """
    now = net = 0.0
    for count, backward_s, sync_s in parts:
        whole = max(1, round(count))
        for _ in range(whole):
            now += backward_s * count / whole
            if sync_s > 0:
                net = max(net, now) + sync_s * count / whole
    return max(0.0, net - now)


def _peak_rate(hw: HardwareProfile, dtype: str) -> float:
    """The profile's dense peak for ``dtype`` (a 16-bit dtype falls back to its twin)."""
    for key in (dtype, {"float16": "bfloat16", "bfloat16": "float16"}.get(dtype, dtype)):
        if key in hw.flops_per_s:
            return float(hw.flops_per_s[key])
    return 0.0


def _overlapped(res: Any, strategy: GPTStrategy) -> bool:
    """A backward sequence-parallel all-gather or reduce-scatter: Megatron overlaps these with
    the weight-gradient GEMMs (Korthikanti et al. 2022, section 4.2.2)."""
    return (
        strategy.sequence_parallel
        and res.phase == "backward"
        and bool(res.steps)
        and all(st.kind in ("all_gather", "reduce_scatter") for st in res.steps)
    )


@dataclass
class OffloadEstimate:
    """``--offload``: the optimizer's states and master weights in host memory, moved for the update.

    What ``dist.offload_optimizer(opt, master_weight=True)`` does: the device no longer holds the
    ``optimizer_state`` bytes (so each rank's peak drops by exactly its share), and every step
    copies them host -> device before the update and device -> host after it, one direction at
    a time at the profile's ``host_link_Bps`` (no overlap with compute assumed).
    """

    host_bytes_per_rank: dict[int, int]
    device_peak_bytes_per_rank: dict[int, int]
    host_link_Bps: float | None
    """``None``: host and device share one memory (a CPU profile): the move costs nothing."""
    transfer_s: float
    """The busiest rank's two copies per step."""
    step_time_s: float

    def to_dict(self) -> dict[str, Any]:
        ranks = sorted(self.host_bytes_per_rank)
        return {
            "host_bytes_per_rank": [self.host_bytes_per_rank[r] for r in ranks],
            "device_peak_bytes_per_rank": [self.device_peak_bytes_per_rank[r] for r in ranks],
            "host_link_Bps": self.host_link_Bps,
            "transfer_s": self.transfer_s,
            "step_time_s": self.step_time_s,
        }

    def summary(self) -> str:
        gib = 2.0**30
        rank = max(self.device_peak_bytes_per_rank, key=lambda r: self.device_peak_bytes_per_rank[r])
        link = (
            "host and device share memory"
            if self.host_link_Bps is None
            else f"host link {self.host_link_Bps / 1e9:g} GB/s"
        )
        return (
            f"offload: optimizer states + master weights to host memory, up to "
            f"{max(self.host_bytes_per_rank.values(), default=0) / gib:.2f} GiB per rank; "
            f"device peak {self.device_peak_bytes_per_rank[rank] / gib:.2f} GiB (rank {rank}); "
            f"{link}: +{self.transfer_s:.4g} s per step -> step time {self.step_time_s:.4g} s"
        )


def offload_estimate(result: Estimate, host_link_Bps: float | None) -> OffloadEstimate:
    """``result`` with the optimizer's states (and master weights) moved to host memory."""
    if host_link_Bps is not None and not host_link_Bps > 0:
        raise ValueError(f"--host-link-bandwidth must be > 0 bytes/s, got {host_link_Bps!r}")
    states = result.model_state_by_category.get("optimizer_state", {})
    host = {r: states.get(r, 0) for r in result.peak_bytes_per_rank}
    peaks = {r: result.peak_bytes_per_rank[r] - host[r] for r in result.peak_bytes_per_rank}
    transfer = 0.0 if host_link_Bps is None else max((2 * n / host_link_Bps for n in host.values()), default=0.0)
    return OffloadEstimate(host, peaks, host_link_Bps, transfer, result.step_time_s + transfer)


class _Ledger:
    """Seconds per rank, kept as one number per group of ranks where all ranks pay the same."""

    def __init__(self) -> None:
        self.shared: dict[tuple[int, ...], float] = {}
        self.own: dict[int, float] = {}
        self._members: dict[tuple[int, ...], frozenset[int]] = {}

    def add(self, ranks: tuple[int, ...], value: float | dict[int, float]) -> None:
        if isinstance(value, dict):
            for r, v in value.items():
                self.own[r] = self.own.get(r, 0.0) + v
        elif ranks:
            self.shared[ranks] = self.shared.get(ranks, 0.0) + value
            if ranks not in self._members:
                self._members[ranks] = frozenset(ranks)

    def at(self, rank: int) -> float:
        return self.own.get(rank, 0.0) + sum(v for k, v in self.shared.items() if rank in self._members[k])

    def most(self) -> float:
        ranks = set(self.own).union(*self._members.values()) if self._members else set(self.own)
        return max((self.at(r) for r in ranks), default=0.0)


_EMPTY = _Ledger()
"""No seconds on any rank (a part with nothing in a bucket)."""


def _peak_in_flight_bytes(schedule: Schedule, rank: int, stage_bytes: dict[int, int]) -> int:
    """Most activation bytes held at once on pipeline rank ``rank``, walking its actions in order."""
    done = final_backward_kind(schedule.split_backward)
    live = peak = 0
    for action in schedule.actions[rank]:
        if action.kind == "F":
            live += stage_bytes[action.stage]
            peak = max(peak, live)
        elif action.kind == done:
            live -= stage_bytes[action.stage]
    return peak


# ---------------------------------------------------------------------- command line
def parse_count(text: str) -> float:
    """``175e9``, ``175B``, ``1.3b``, ``350M``, ``6.7e9`` -> a positive finite number below 1e16."""
    return cliargs.parse_count(text, "--params")


def parse_mesh(text: str) -> dict[str, int]:
    """``dp=8,tp=8,pp=16`` (and ``cp=``) -> degrees of ``dp``, ``tp``, ``pp``, ``cp`` (1 where not given)."""
    return cliargs.parse_degrees(text, ("dp", "tp", "pp", "cp"), "--mesh")


_rate = cliargs.finite_float(1e-300, 1e30, "a positive rate")
_seconds = cliargs.finite_float(0.0, 3600.0, "seconds")


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(
        prog="python -m simulator estimate",
        description="Memory and step time of GPT training from a shape-only trace (no data, any number of ranks).",
    )
    m = p.add_argument_group("model (give --layers/--hidden/--heads, or --params)")
    m.add_argument("--layers", type=cliargs.positive_int, help="transformer layers")
    m.add_argument("--hidden", type=cliargs.positive_int, help="hidden size h")
    m.add_argument("--heads", type=cliargs.positive_int, help="attention heads a")
    m.add_argument(
        "--params",
        help="a parameter count (175e9, 175B, 350M): picks a GPT-3-style shape (head size 128, layers = heads)",
    )
    m.add_argument(
        "--seq", type=cliargs.positive_int, default=None, help="sequence length s (default 2048, or the preset's)"
    )
    m.add_argument(
        "--vocab", type=cliargs.positive_int, default=None, help="vocabulary size (default 50257, or the preset's)"
    )
    m.add_argument(
        "--micro-batch-size",
        type=cliargs.positive_int,
        default=1,
        help="sequences per micro-batch per data-parallel replica (default 1)",
    )
    m.add_argument(
        "--dropout",
        type=cliargs.finite_float(0.0, 1.0, "a probability"),
        default=None,
        help="dropout probability (default 0.1 for GPT shapes, 0 for RMSNorm ones; 0 keeps no masks)",
    )
    add_family_arguments(p.add_argument_group("model family (simulator.family_cli: the closed-form family model)"))
    s = p.add_argument_group("strategy")
    s.add_argument("--mesh", default="dp=1", help="degrees, e.g. dp=8,tp=8,pp=16 (cp=4: context parallel)")
    s.add_argument("--sequence-parallel", action="store_true")
    s.add_argument(
        "--cp-comm",
        choices=["allgather", "ring"],
        default="allgather",
        help="context parallel: all-gather keys and values (exposed) or pass them around the cp ring "
        "(point-to-point, hidden behind the attention core)",
    )
    s.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    s.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp")
    s.add_argument(
        "--mixed-precision",
        action="store_true",
        help="float16 parameters and gradients, float32 master weights and states",
    )
    s.add_argument("--optimizer", default="adamw", choices=["adamw", "momentum"])
    s.add_argument("--micro-batches", type=cliargs.positive_int, default=1, help="micro-batches per step (default 1)")
    s.add_argument("--schedule", default="1F1B", help="FThenB, 1F1B, Interleaved1F1B or ZBH1 (default 1F1B)")
    s.add_argument(
        "--chunks",
        type=cliargs.positive_int,
        default=None,
        help="model chunks per pipeline rank (Interleaved1F1B; default 2)",
    )
    s.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="gradient reductions run while backward runs (dist.overlap_grad_reduction): only the unhidden part is paid",
    )
    s.add_argument(
        "--grad-clip",
        type=cliargs.finite_float(0.0, what="a non-negative norm"),
        default=None,
        metavar="NORM",
        help="global-norm gradient clipping",
    )
    h = p.add_argument_group("hardware")
    h.add_argument(
        "--hardware",
        default=None,
        help="a preset (h100-nvlink-ib, h100-sxm, a100-nvlink-ib, cpu-local) or a profile JSON (default "
        "h100-nvlink-ib; h100-sxm, its GPU model, for the family model)",
    )
    h.add_argument(
        "--memory-bandwidth",
        type=_rate,
        default=None,
        metavar="BYTES_PER_S",
        help="price each op at max(FLOPs/rate, bytes/bandwidth) (default: FLOPs only)",
    )
    h.add_argument(
        "--vector-flops",
        type=_rate,
        default=None,
        metavar="FLOP_PER_S",
        help="FLOP rate of non-matmul ops and optimizer updates (default: the profile's vector_curve at "
        "each op's size where it has one, else its matmul rate)",
    )
    h.add_argument(
        "--op-overhead",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="host time per op (default: the profile's op_overhead_s, 0 in the presets; a calibrated "
        "profile's measured host costs)",
    )
    h.add_argument(
        "--reshard-overhead",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="host time per reshard call, besides its collectives (default: --op-overhead)",
    )
    h.add_argument(
        "--update-overhead",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="host time per parameter the optimizer updates (default: --op-overhead)",
    )
    h.add_argument(
        "--offload",
        action="store_true",
        help="optimizer states and master weights in host memory, copied over the host link every step",
    )
    h.add_argument(
        "--host-link-bandwidth",
        type=_rate,
        default=None,
        metavar="BYTES_PER_S",
        help="host <-> device bandwidth per direction for --offload (default: the profile's host_link_Bps)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the estimate as JSON")
    o.add_argument(
        "--breakdown",
        action="store_true",
        help="also print, per stage, the ms by op family (gemm, norm, elementwise, ...) and communication, and the bubble",
    )
    o.add_argument(
        "--plan", metavar="PATH", type=cliargs.output_path, help="also write the traced plan (mpipar.plan JSON)"
    )
    return p


def from_args(ns: argparse.Namespace) -> tuple[GPTShape, GPTStrategy]:
    """The traced GPT and strategy the command line asks for (``ValueError`` naming the flag at fault)."""
    resolve_gpt_defaults(ns)
    explicit = {k: getattr(ns, k) for k in ("layers", "hidden", "heads")}
    if ns.params is not None:
        given = [f"--{k}" for k, v in explicit.items() if v is not None]
        if given:
            raise ValueError(f"--params picks the layers, hidden size and heads; drop {', '.join(given)} or --params")
        shape = GPTShape.from_params(parse_count(ns.params), ns.seq, ns.vocab, ns.micro_batch_size)
        if ns.dropout != shape.dropout:
            shape = GPTShape(
                shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab, shape.micro_batch_size, ns.dropout
            )
    else:
        missing = [f"--{k}" for k, v in explicit.items() if v is None]
        if missing:
            raise ValueError(f"the model needs {', '.join(missing)} (or --params N to pick a GPT-3-style shape)")
        shape = GPTShape(ns.layers, ns.hidden, ns.heads, ns.seq, ns.vocab, ns.micro_batch_size, ns.dropout)
    deg = parse_mesh(ns.mesh)
    if deg["cp"] > 1:
        raise ValueError("cp > 1 is priced by the family model; give the shape with --model or the family flags")
    interleaved = ns.schedule.strip().lower() in ("interleaved1f1b", "interleaved", "vpp")
    chunks = ns.chunks if ns.chunks is not None else (2 if interleaved else 1)
    # Each count is bounded by its parser; what the estimate's loops run over are their products.
    cliargs.check_product({"--layers": shape.layers}, cliargs.MAX_LAYERS, "layers")
    cliargs.check_product(
        {"--micro-batches": ns.micro_batches, "pp": deg["pp"], "--chunks": chunks},
        cliargs.MAX_SCHEDULE_SLOTS,
        "pipeline slots",
    )
    strategy = GPTStrategy(
        deg["dp"],
        deg["tp"],
        deg["pp"],
        ns.sequence_parallel,
        ns.recompute,
        ns.zero,
        ns.mixed_precision,
        ns.optimizer,
        ns.micro_batches,
        ns.schedule,
        chunks,
        ns.grad_clip,
    )
    return shape, strategy


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        degrees = parse_mesh(ns.mesh)
        if wants_family(ns, degrees["cp"]):
            return run_estimate(ns, degrees)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        shape, strategy = from_args(ns)
        profile = load_profile(ns.hardware)
        started = time.perf_counter()
        step = trace_gpt_step(shape, strategy)
        result = estimate(
            shape,
            strategy,
            profile,
            memory_bandwidth=ns.memory_bandwidth,
            vector_flops=ns.vector_flops,
            op_overhead=ns.op_overhead,
            reshard_overhead=ns.reshard_overhead,
            update_overhead=ns.update_overhead,
            step=step,
            overlap_grad_reduce=ns.overlap_grad_reduce,
        )
        if ns.host_link_bandwidth is not None and not ns.offload:
            raise ValueError("--host-link-bandwidth prices --offload's copies; add --offload or drop it")
        offload = offload_estimate(result, ns.host_link_bandwidth or profile.host_link_Bps) if ns.offload else None
    except ValueError as exc:
        parser.error(printable(exc))  # a profile's or plan's text reaches no terminal raw
    if ns.plan:
        try:
            step.plan.save(ns.plan)
        except OSError as exc:
            return cliargs.write_failure(parser.prog, ns.plan, exc)
    if ns.json:
        out = result.to_dict()
        out["seconds"] = time.perf_counter() - started
        if offload is not None:
            out["offload"] = offload.to_dict()
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(printable(result.summary(), keep_newlines=True))
        if ns.breakdown:
            print()
            print(printable(result.breakdown(), keep_newlines=True))
        if offload is not None:
            print(offload.summary())
        if ns.plan:
            print(f"wrote {ns.plan}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
