"""The dashboard's built-in sample: a 3-D hybrid (dp x tp x pp) MLP training step, traced and simulated.

    plan, timeline = build_sample(dp=2, tp=2, pp=2, schedule="1F1B", microbatches=4)
    python -m viz.sample --dp 2 --tp 2 --pp 2 -o plan.json --timeline timeline.json

The model is written directly with mpipar ops: each pipeline stage holds
``layers_per_stage`` pre-norm residual blocks (layer norm, linear ``h -> 4h`` split by
columns over ``tp``, gelu, linear ``4h -> h`` split by rows, residual add) on its own
``dp x tp`` mesh; the batch is split over ``dp``. Stage hand-offs are ``dist.reshard`` to the
next stage's mesh (seed 000 §4.4), forward and, for the gradient, backward. The last stage
takes the mean as the loss; every stage runs its backward; then momentum SGD updates every
parameter (one velocity per parameter: the optimizer state). ``Interleaved1F1B`` gives each
pipeline rank two model chunks (``2 * pp`` stages, stage ``s`` on rank ``s mod pp``).

One micro-batch is traced with ``mpipar.trace`` (numerically, or shape-only for big meshes);
from the plan come:

* the cost of each stage on a hardware preset: matmul FLOPs of its forward and backward ops at
  the busiest rank, plus the time of the collectives its ops inserted (alpha-beta formulas of
  ``simulator.cost``); stage hand-offs as the time of their reshard steps; gradient
  synchronisation (the reshards making parameter gradients) and the optimizer once per step,
  after the pipeline flush;
* memory per rank: parameters, gradients and optimizer state from the plan's tensors of those
  kinds; activations of one micro-batch of a stage as what its tape keeps for backward (the
  trace's ``meta.kept_for_backward``, ``viz.plan_memory``); one hand-off message as a
  communication buffer;
* the schedule (``mpipar.pipeline.build_schedule``) simulated by ``simulator.simulate_schedule``.

Knobs: ``zero=1`` keeps each velocity split over ``dp`` (the layout rule of
``dist.ShardingStage1``): the update runs on the slice and the new parameter is all-gathered;
``zero=2`` also keeps each gradient in that split layout, so the data-parallel reduction is a
reduce_scatter. ``recompute="full"`` wraps each block in ``dist.recompute`` (only its input is
kept; backward runs its forward again), ``"selective"`` only the ``fc1 + gelu`` part. ZeRO-3
is refused (``UNSUPPORTED`` says why; the dashboard shows it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import mpipar as dist
from mpipar import hooks
from mpipar.compile.plan import Plan, PlanReshard
from mpipar.compile.trace import trace
from mpipar.debug.timeline import Timeline
from mpipar.pipeline import resolve_kind
from mpipar.pipeline.schedule import build_schedule
from simulator import ShapeOnlyBackend, SimBackend
from simulator.cost import HardwareProfile, load_profile
from viz.plan_memory import RECOMPUTE_SCOPE, memory_section
from viz.planinfo import group_size, plan_mesh, spec_of, stage_of
from viz.simulate import simulate_plan_lanes

F = dist.nn.functional

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")
UNSUPPORTED: dict[str, str] = {
    "zero=3": "ZeRO-3 needs parameters gathered per use in forward and backward; the sample's hand-written "
    "optimizer does not do that (the GPT sample with dist.shard_optimizer will)",
}
"""Knob values the sample cannot honour, with the reason the dashboard shows beside them."""

HANDOFF = "pipeline hand-off"
MOMENTUM, LR = 0.9, 0.01


@dataclass(frozen=True)
class SampleConfig:
    dp: int = 2
    tp: int = 2
    pp: int = 2
    schedule: str = "1F1B"
    microbatches: int = 4
    zero: int = 0
    recompute: str = "none"
    shape_only: bool = False
    hidden: int = 256
    batch: int = 32
    """Rows of one micro-batch (split over dp)."""
    layers_per_stage: int = 1
    dtype: str = "float32"
    profile: str = "cpu-local"
    """Hardware preset of ``simulator.cost`` the costs are computed on (or a profile JSON path)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "hidden", "batch", "layers_per_stage"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sample {name} must be a positive int, got {value!r}")
        object.__setattr__(self, "schedule", resolve_kind(self.schedule).name)
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"sample zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"sample recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.zero == 3:
            raise ValueError(f"sample zero=3 cannot be honoured: {UNSUPPORTED['zero=3']}; use zero 0, 1 or 2")

    @property
    def chunks(self) -> int:
        return 2 if resolve_kind(self.schedule).virtual_stages else 1

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def build_sample(
    dp: int = 2,
    tp: int = 2,
    pp: int = 2,
    schedule: str = "1F1B",
    microbatches: int = 4,
    zero: int = 0,
    recompute: str = "none",
    shape_only: bool = False,
    **options: Any,
) -> tuple[Plan, Timeline]:
    """Trace, cost and simulate the sample (module docstring); ``options`` are other ``SampleConfig`` fields."""
    config = SampleConfig(dp, tp, pp, schedule, microbatches, zero, recompute, shape_only, **options)
    return _build(config)


@functools.lru_cache(maxsize=32)
def _build(config: SampleConfig) -> tuple[Plan, Timeline]:
    backend = ShapeOnlyBackend() if config.shape_only else SimBackend()
    with dist.use_backend(backend):
        plan = _trace(config)
    profile = load_profile(config.profile)
    plan = dataclasses.replace(plan, pipeline=_pipeline_section(plan, config, profile))
    plan = dataclasses.replace(plan, memory=memory_section(plan, profile.memory_bytes, profile.name))
    return plan, simulate_plan_lanes(plan)


# ------------------------------------------------------------------------------ the model
def _trace(c: SampleConfig) -> Plan:
    n = c.dp * c.tp
    meshes = [
        dist.ProcessMesh(np.arange(lane * n, (lane + 1) * n).reshape(c.dp, c.tp), dim_names=["dp", "tp"])
        for lane in range(c.pp)
    ]
    dtype = np.dtype(c.dtype)
    rng = np.random.default_rng(0)
    h, f = c.hidden, 4 * c.hidden

    def tensor(shape: tuple[int, ...], name: str, trainable: bool, scale: float = 0.1) -> dist.Tensor:
        if c.shape_only:
            t = dist.Tensor.abstract(shape, dtype)
        else:
            t = dist.Tensor((rng.standard_normal(shape) * scale).astype(dtype))
        t.stop_gradient = not trainable
        t.name = name
        return t

    def zeros(shape: tuple[int, ...], name: str) -> dist.Tensor:
        t = dist.Tensor.abstract(shape, dtype) if c.shape_only else dist.Tensor(np.zeros(shape, dtype))
        t.name = name
        return t

    R, S = dist.Replicate(), dist.Shard
    params: list[tuple[str, dist.Tensor, dist.ProcessMesh, list[Any]]] = []
    blocks: list[list[dict[str, dist.Tensor]]] = []
    for s in range(c.stages):
        mesh = meshes[s % c.pp]
        stage_blocks = []
        for layer in range(c.layers_per_stage):
            prefix = f"stage{s}.block{layer}"
            layouts = {
                "ln.weight": ((h,), [R, R], 1.0),
                "ln.bias": ((h,), [R, R], 0.0),
                "fc1.weight": ((h, f), [R, S(1)], 0.1),
                "fc2.weight": ((f, h), [R, S(0)], 0.1),
            }
            block = {}
            for key, (shape, pls, scale) in layouts.items():
                t = dist.shard_tensor(tensor(shape, f"{prefix}.{key}", True, scale), mesh, pls)
                block[key] = t
                params.append((f"{prefix}.{key}", t, mesh, pls))
            stage_blocks.append(block)
        blocks.append(stage_blocks)
    x = dist.shard_tensor(tensor((c.batch, h), "x", False, 1.0), meshes[0], [S(0), R])
    # ZeRO-1/2: optimizer state (and, at 2, the gradient) split over dp by the library's own layout rule.
    zero_pls = []
    for _, p, _, pls in params:
        layout = dist.ShardingStage1("dp").layout(p) if c.zero >= 1 else None
        zero_pls.append(list(layout.placements) if layout is not None else list(pls))
        if c.zero >= 2 and layout is not None:
            p.grad_placements = list(layout.placements)
    velocity = [
        dist.shard_tensor(zeros(tuple(p.shape), f"{name}.velocity"), mesh, zpls)
        for (name, p, mesh, _), zpls in zip(params, zero_pls, strict=True)
    ]

    meta = {
        "builder": "viz.sample",
        "config": dataclasses.asdict(c),
        "world_size": c.world_size,
        "shape_only": c.shape_only,
        "model": f"{c.stages}-stage residual MLP, hidden {h}",
    }
    with trace(meta) as rec:
        for (name, p, _, _), v in zip(params, velocity, strict=True):
            rec.mark(p, "parameter", name)
            rec.mark(v, "optimizer_state", f"{name}.velocity")
        rec.mark(x, "input", "x")
        stage_in: list[dist.Tensor] = [x]
        stage_out: list[dist.Tensor] = []
        for s in range(c.stages):
            hcur = stage_in[s]
            for layer, block in enumerate(blocks[s]):
                with hooks.scope(f"stage{s}.block{layer}"):
                    if c.recompute == "full":
                        hcur = dist.recompute(_recomputed(_block), hcur, block, h)
                    else:
                        hcur = _block(hcur, block, h, selective=c.recompute == "selective")
            stage_out.append(hcur)
            if s + 1 < c.stages:
                # A new leaf on the next stage: pipelines hand activations over, not autograd graphs.
                with dist.no_grad(), dist.comm_context(f"{HANDOFF} stage {s} -> {s + 1}"):
                    nxt = dist.reshard(hcur, meshes[(s + 1) % c.pp], [S(0), R])
                nxt.stop_gradient = False
                stage_in.append(nxt)
        with hooks.scope(f"stage{c.stages - 1}.loss"):
            loss = dist.mean(stage_out[-1])
        for s in reversed(range(c.stages)):
            with hooks.scope(f"stage{s}"):
                if s == c.stages - 1:
                    loss.backward()
                else:
                    received = stage_in[s + 1].grad
                    with hooks.phase("backward"), dist.comm_context(f"{HANDOFF} stage {s + 1} -> {s} (gradient)"):
                        grad = dist.reshard(received, stage_out[s].process_mesh, list(stage_out[s].placements))
                    stage_out[s].backward(grad)
        with hooks.phase("optimizer"), hooks.scope("optimizer"), dist.no_grad():
            for (name, p, mesh, pls), v, zpls in zip(params, velocity, zero_pls, strict=True):
                assert p.grad is not None
                rec.mark(p.grad, "gradient", f"{name}.grad")
                split = zpls != list(pls)
                grad = dist.reshard(p.grad, mesh, zpls) if split else p.grad  # ZeRO-1: a local slice
                v_new = dist.add(dist.scale(v, MOMENTUM), grad)
                p_new = dist.subtract(dist.reshard(p, mesh, zpls) if split else p, dist.scale(v_new, LR))
                if split:
                    with dist.comm_context(f"updated {name} back to its layout"):
                        dist.reshard(p_new, mesh, pls)  # ZeRO: all_gather over dp
    return rec.plan()


def _block(x: dist.Tensor, block: dict[str, dist.Tensor], h: int, selective: bool = False) -> dist.Tensor:
    """Pre-norm residual MLP block; ``selective`` recomputes fc1 + gelu (the widest activations)."""
    with hooks.scope("ln"):
        y = F.layer_norm(x, h, block["ln.weight"], block["ln.bias"])  # (B, h)
    with hooks.scope("fc1"):
        if selective:
            y = dist.recompute(_recomputed(_fc1_gelu), y, block["fc1.weight"])  # (B, 4h)
        else:
            y = _fc1_gelu(y, block["fc1.weight"])  # (B, 4h)
    with hooks.scope("fc2"):
        y = dist.matmul(y, block["fc2.weight"])  # (B, h)
    with hooks.scope("residual"):
        return dist.add(x, y)


def _fc1_gelu(y: dist.Tensor, w: dist.Tensor) -> dist.Tensor:
    return F.gelu(dist.matmul(y, w))


def _recomputed(fn: Any) -> Any:
    """``fn`` run inside a ``recompute`` scope, so the plan shows which ops are not kept."""

    def run(*args: Any) -> Any:
        with hooks.scope(RECOMPUTE_SCOPE):
            return fn(*args)

    return run


# ------------------------------------------------------------------------------ costs
def _buffer_bytes(kind: str, received: float, n: int) -> float:
    """Invert the planner's bytes received per rank into the buffer size the cost formulas take."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return received * n / (2 * (n - 1))
    return received * n / (n - 1)


def reshard_time(plan: Plan, r: PlanReshard, profile: HardwareProfile) -> float:
    """Seconds of one reshard on ``profile``: its collectives and transfers, one after the other."""
    total = 0.0
    mesh = plan_mesh(plan, r.src_mesh)
    for step in r.steps:
        if step.kind == "transfer":
            busiest: dict[int, float] = {}
            pairs: dict[int, tuple[int, int]] = {}
            for src, dst, nbytes in step.pieces:
                busiest[dst] = busiest.get(dst, 0.0) + nbytes
                pairs.setdefault(dst, (src, dst))
            if busiest:
                dst = max(busiest, key=lambda k: busiest[k])
                total += profile.p2p_time(busiest[dst], *pairs[dst])
        elif step.kind not in ("slice", "partial"):
            on = mesh if step.kind != "all_gather" or r.src_mesh == r.dst_mesh else plan_mesh(plan, r.dst_mesh)
            n = group_size(on, step.axes)
            group = on.groups([on.dim_names.index(a) for a in step.axes])[0]
            total += profile.collective_time(step.kind, _buffer_bytes(step.kind, step.bytes_per_rank, n), group)
    return total


def _matmul_flops(plan: Plan, op: Any, rank: int) -> float:
    """2 m k n of one matmul at ``rank`` from the local shapes of its (resharded) inputs and output."""
    sizes = []
    for tid, pls in [*zip(op.inputs, op.required_placements, strict=False), (op.outputs[0], op.output_placements[0])]:
        t = plan.tensor(tid)
        if t.mesh is None:
            shape = t.shape
        else:
            spec = spec_of(plan, t.shape, t.mesh, pls)
            shape = spec.local_shape(rank) if rank in spec.boxes else t.shape
        sizes.append(float(np.prod(shape, dtype=np.float64)))
    # (m k)(k n)(m n) = (m k n)^2 for 2-d operands
    return 2.0 * float(np.sqrt(sizes[0] * sizes[1] * sizes[2]))


def _pipeline_section(plan: Plan, c: SampleConfig, profile: HardwareProfile) -> dict[str, Any]:
    lane_mesh = {m.process_ids[0] // (c.dp * c.tp): m.id for m in plan.meshes}
    mesh_lane = {mid: lane for lane, mid in lane_mesh.items()}
    stage_mesh = {s: lane_mesh[s % c.pp] for s in range(c.stages)}
    forward_flops = [0.0] * c.stages
    backward_flops = [0.0] * c.stages
    forward_comm = [0.0] * c.stages
    backward_comm = [0.0] * c.stages
    for op in plan.ops:
        s = stage_of(plan, op)
        if s is None or op.phase not in ("forward", "backward"):
            continue
        if op.op == "matmul":
            ranks = plan.mesh(stage_mesh[s]).process_ids
            flops = max(_matmul_flops(plan, op, r) for r in ranks[: min(len(ranks), 64)])
            (forward_flops if op.phase == "forward" else backward_flops)[s] += flops
        for ri in op.reshards:
            t = reshard_time(plan, plan.reshards[ri], profile)
            (forward_comm if op.phase == "forward" else backward_comm)[s] += t
    send_forward = [0.0] * max(c.stages - 1, 0)
    send_backward = [0.0] * max(c.stages - 1, 0)
    grad_sync = [0.0] * c.pp
    param_gather = [0.0] * c.pp
    for r in plan.reshards:
        if r.reason.startswith(HANDOFF):
            s = int(r.reason.split("stage ")[1].split(" ")[0])
            if "(gradient)" in r.reason:
                send_backward[s - 1] += reshard_time(plan, r, profile)
            else:
                send_forward[s] += reshard_time(plan, r, profile)
        elif r.phase == "optimizer":
            param_gather[mesh_lane[r.src_mesh]] += reshard_time(plan, r, profile)
        elif r.op is None and plan.tensor(r.new_tensor).kind == "gradient":
            grad_sync[mesh_lane[r.src_mesh]] += reshard_time(plan, r, profile)
        elif r.op is None and r.phase == "backward":
            # A stage input's gradient brought to its layout: part of that stage's backward.
            owners = [s for s in range(c.stages) if stage_mesh[s] == r.src_mesh]
            for s in owners:
                backward_comm[s] += reshard_time(plan, r, profile) / len(owners)
    optimizer_flops = [0.0] * c.pp  # one FLOP per element of each update op, at the biggest shard
    for op in plan.ops:
        if op.phase == "optimizer" and op.outputs:
            t = plan.tensor(op.outputs[0])
            if t.mesh is not None:
                optimizer_flops[mesh_lane[t.mesh]] += max(float(np.prod(s)) for s in t.local_shapes or [t.shape])
    fwd = [profile.compute_time(forward_flops[s], c.dtype) + forward_comm[s] for s in range(c.stages)]
    # Each backward matmul here is the input or the weight gradient of one linear, at equal FLOPs.
    half = [profile.compute_time(backward_flops[s] / 2, c.dtype) for s in range(c.stages)]
    b_in = [half[s] + backward_comm[s] for s in range(c.stages)]
    sched = build_schedule(c.schedule, c.stages, c.microbatches, c.chunks)
    step_end = {
        str(lane): [
            {"name": "gradient sync", "kind": "COLL", "track": "comm", "duration": grad_sync[lane]},
            {
                "name": "optimizer",
                "kind": "OPT",
                "track": "compute",
                "duration": profile.compute_time(optimizer_flops[lane], c.dtype),
            },
        ]
        + (
            [{"name": "parameter all_gather (ZeRO)", "kind": "COLL", "track": "comm", "duration": param_gather[lane]}]
            if param_gather[lane]
            else []
        )
        for lane in range(c.pp)
    }
    return {
        "stages": [{"stage": s, "mesh": stage_mesh[s], "rank": s % c.pp} for s in range(c.stages)],
        "num_microbatches": c.microbatches,
        "schedule": sched.to_dict(),
        "cost": {
            "time_unit": "s",
            "profile": profile.name,
            "forward": fwd,
            "backward_input": b_in,
            "backward_weight": half,
            "send_forward": send_forward,
            "send_backward": send_backward,
            "forward_flops": forward_flops,
            "backward_flops": backward_flops,
        },
        "step_end": step_end,
    }


# ------------------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viz.sample", description="Write the dashboard's sample plan.")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("-m", "--microbatches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--profile", default="cpu-local", help="hardware preset or profile JSON")
    parser.add_argument("--shape-only", action="store_true")
    parser.add_argument("-o", "--output", default="plan.json")
    parser.add_argument("--timeline", default=None)
    ns = parser.parse_args(argv)
    try:
        plan, timeline = build_sample(
            ns.dp,
            ns.tp,
            ns.pp,
            ns.schedule,
            ns.microbatches,
            shape_only=ns.shape_only,
            hidden=ns.hidden,
            batch=ns.batch,
            profile=ns.profile,
        )
    except ValueError as exc:
        parser.error(str(exc))
    plan.save(ns.output)
    print(plan.summary())
    print(f"wrote {ns.output}")
    if ns.timeline:
        timeline.save(ns.timeline)
        print(f"wrote {ns.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
