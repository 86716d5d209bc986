"""One GPT training step traced shape-only, every event labelled with the part of the model it serves.

    shape = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257)
    strategy = GPTStrategy(dp=8, tp=8, pp=16, sequence_parallel=True, mixed_precision=True)
    step = trace_gpt_step(shape, strategy)
    step.plan                         # mpipar.compile.plan.Plan: one micro-batch forward, backward, one optimizer step
    step.op_parts[i]                  # the Part plan.ops[i] belongs to (Part("layer", 3), Part("first"), ...)
    step.activations[Part("layer", 0)]   # {rank: bytes kept for backward by that layer, one micro-batch}

The model is ``mpipar.models.gpt.GPT`` with ``GPTParallel`` laid out on ``pp * chunks`` stage
meshes of ``dp x tp`` ranks, traced under ``simulator.ShapeOnlyBackend`` (layouts and shapes,
no values) with **two transformer layers per pipeline stage** (all of them where a stage has
only one): the layers are identical, so the estimator scales them to the layers each stage
really holds. Two, not one, because a layer's backward leaves its input gradient Partial over
``tp`` for the consumer to reduce: inside a stage the layer before pays that reduction, at a
stage's first layer the pipeline hand-off does. The first traced layer of a stage is the
interior layer (it pays its successor's reduction) and stands for all but the stage's last
layer; the second is that last one. ``tests/unit/test_estimate.py`` checks the scaled estimate
against a trace of every layer.

Parts: ``layer i`` (everything block ``i`` does: its forward ops, the backward of its tape
nodes -- recomputation included --, its parameters' gradient reduction and optimizer
update), ``first`` (embedding, on the first stage), ``last`` (final norm, head, loss, on the
last stage) and ``handoff i`` (the pipeline transfer into block ``i``, forward and backward).
Forward events are labelled by the block running them (layer pre/post hooks); each tape node
keeps the label of the part that recorded it, and backward events are labelled by the node
whose gradient function (or saved-tensor note) is running.

Memory read off the trace, per rank:

* activations: what the tape nodes keep for backward (``mpipar.debug.memory.kept_tensors``: each
  storage once, parameters excluded, a re-gather note as the shard it gathers from), by part;
* parameters, gradients (after backward) and optimizer states (after ``step()``, which
  creates them in the optimizer's layout: ZeRO split, float32 masters under mixed
  precision), by the part whose forward first used the parameter.

The optimizer steps twice: the first creates its states (labelled ``setup``), the second is
the steady-state update the estimator prices. A parameter's gradient reduction (the reshard
that brings its gradient to its layout: data parallelism's all-reduce, ZeRO's
reduce-scatter) is marked ``grad_sync``: once per step, not per micro-batch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import mpipar as dist
from mpipar import hooks
from mpipar.autograd import Node, Packed, _topo_order
from mpipar.compile.plan import Plan
from mpipar.compile.trace import PlanRecorder
from mpipar.debug.memory import kept_items
from mpipar.mesh import ProcessMesh
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.pipeline import resolve_kind
from mpipar.reshard.planner import ReshardPlan
from mpipar.spec import DistSpec
from mpipar.tensor import Parameter, Tensor
from simulator.backend import ShapeOnlyBackend

RECOMPUTE = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "momentum")


# ---------------------------------------------------------------------- model and strategy
@dataclass(frozen=True)
class GPTShape:
    """A GPT's sizes: ``micro_batch_size`` sequences per data-parallel replica per micro-batch."""

    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 50257
    micro_batch_size: int = 1
    dropout: float = 0.1
    """Dropout keeps a one-byte mask per element for backward (Megatron's accounting assumes dropout)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTShape {name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTShape hidden ({self.hidden}) must be divisible by heads ({self.heads}); "
                f"try heads={_divisor_near(self.hidden, self.heads)}"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTShape dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def parameters(self) -> int:
        """Parameters of ``mpipar.models.gpt.GPT`` of this shape (untied head, biases everywhere).

        Per layer 12h^2 + 13h (q, k, v, proj: 4h^2 + 4h; fc, proj: 8h^2 + 5h; two norms: 4h);
        embeddings (V + s)h; final norm 2h; head hV + V.
        """
        h, v, s = self.hidden, self.vocab, self.seq
        return self.layers * (12 * h * h + 13 * h) + (v + s) * h + 2 * h + h * v + v

    @classmethod
    def from_params(cls, n: float, seq: int = 2048, vocab: int = 50257, micro_batch_size: int = 1) -> GPTShape:
        """The GPT-3-style shape closest to ``n`` parameters.

        Head size 128 and as many layers as heads (GPT-3 175B's proportions: h = 128 * 96,
        96 layers): among hidden sizes h = 128 * a, a = 1, 2, ..., the one whose parameter
        count is nearest ``n``. ``from_params(175e9)`` is GPT-3 175B (h 12288, 96 layers and
        heads); ``6.7e9`` gives h 4096, 32 layers, as GPT-3 6.7B.
        """
        if not n >= 1:
            raise ValueError(f"--params must be a positive number of parameters, got {n!r}")
        best: GPTShape | None = None
        a = 1
        while True:
            shape = cls(layers=a, hidden=128 * a, heads=a, seq=seq, vocab=vocab, micro_batch_size=micro_batch_size)
            if best is None or abs(shape.parameters - n) < abs(best.parameters - n):
                best = shape
            if shape.parameters > n:
                return best
            a += 1


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))


@dataclass(frozen=True)
class GPTStrategy:
    """How the step is parallelised: degrees, sequence parallel, recompute, ZeRO, precision, pipeline."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    zero: int = 0
    mixed_precision: bool = False
    """16-bit parameters and gradients, float32 master weights and optimizer states."""
    optimizer: str = "adamw"
    micro_batches: int = 1
    schedule: str = "1F1B"
    chunks: int = 1
    """Model chunks per pipeline rank (``Interleaved1F1B``'s virtual stages)."""
    grad_clip: float | None = None
    """Global-norm gradient clipping (``ClipGradByGlobalNorm``); traced as a step that clips."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTStrategy {name} must be a positive int, got {value!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"GPTStrategy recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"GPTStrategy zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"GPTStrategy optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        kind = resolve_kind(self.schedule)
        object.__setattr__(self, "schedule", kind.name)
        if self.chunks > 1 and not kind.virtual_stages:
            raise ValueError(f"GPTStrategy chunks={self.chunks} needs schedule Interleaved1F1B, got {self.schedule}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"GPTStrategy grad_clip must be a norm > 0 or None, got {self.grad_clip!r}")

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dtype(self) -> str:
        return "float16" if self.mixed_precision else "float32"


# ---------------------------------------------------------------------- labels
@dataclass(frozen=True, order=True)
class Part:
    """What an event serves: ``layer i``, ``first``, ``last``, ``handoff i`` (into layer i), ``setup``."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.kind} {self.index}" if self.kind in ("layer", "handoff") else self.kind


FIRST, LAST, SETUP = Part("first"), Part("last"), Part("setup")


@dataclass(frozen=True)
class KeptTensor:
    """One tensor a layer keeps for backward, on one rank."""

    op: str
    role: str
    dtype: str
    local_shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class StateRecord:
    """One parameter's model state as layouts: ``entries`` are ``(category, itemsize, placements)``
    (parameter, gradient, each optimizer state) on the stage mesh ``mesh`` (its process ids);
    ``update`` is the layout its update runs in (``None``: dense, every element on every rank)."""

    part: Part
    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    entries: tuple[tuple[str, int, str], ...]
    update: str | None


@dataclass
class StepTrace:
    shape: GPTShape
    strategy: GPTStrategy
    plan: Plan
    stage_ranks: list[tuple[int, ...]]
    layer_stage: list[int]
    """Stage of each traced layer (one per stage unless more were asked for)."""
    op_parts: list[Part]
    reshard_parts: list[Part]
    grad_sync: set[int]
    """Indices of the reshards that reduce a parameter's gradient into its layout."""
    weight_ops: set[int]
    """Indices of forward matmuls with a parameter operand (each has a weight-gradient twin in backward)."""
    activations: dict[Part, dict[int, int]]
    model_state: dict[Part, dict[str, dict[int, int]]]
    """``{part: {"parameters" | "gradients" | "optimizer_state": {rank: bytes}}}``."""
    update_elements: dict[Part, dict[int, int]]
    """Elements each rank updates in the optimizer step (its parameters in their update layouts)."""
    update_counts: dict[Part, int]
    """Parameters updated, by part (each update is one step of the optimizer's loop on every rank)."""
    update_bytes_per_element: float
    """Bytes an update reads and writes per element: parameter, gradient, states (masters included), x2."""
    layer_kept: list[KeptTensor] = field(default_factory=list)
    """What layer 0 keeps for backward on the first rank of its stage."""
    seconds: float = 0.0
    state_records: list[StateRecord] = field(default_factory=list)
    """Per parameter: its shape and the layouts of what it keeps (``simulator.fast_estimate``
    re-evaluates them on a mesh with another data-parallel degree)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stage_of(self, part: Part) -> int:
        """The stage ``part`` runs on (a hand-off: the receiving stage)."""
        if part.kind in ("layer", "handoff"):
            return self.layer_stage[part.index]
        if part.kind == "first":
            return 0
        if part.kind == "last":
            return self.num_stages - 1
        raise ValueError(f"part {part} belongs to no stage")


# ---------------------------------------------------------------------- recorder
class _Recorder(PlanRecorder):
    """A ``PlanRecorder`` that also labels each op and reshard with the current ``Part``."""

    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__(meta)
        self.current = FIRST
        self.op_parts: list[Part] = []
        self.reshard_parts: list[Part] = []
        self.weight_ops: set[int] = set()
        self.node_parts: dict[int, Part] = {}
        self.param_parts: dict[int, Part] = {}
        self.reshard_outs: list[tuple[int, Tensor]] = []
        self.tensor_parts: dict[int, tuple[Part, Tensor]] = {}
        """Optimizer phase: tensors derived from a parameter's gradient, labelled by the parameter."""

    def on_reshard(self, src: Tensor, out: Tensor, plan: ReshardPlan, reason: str) -> None:
        super().on_reshard(src, out, plan, reason)
        self.reshard_parts.append(self.current)
        self.reshard_outs.append((len(self.reshard_parts) - 1, out))

    def on_op(
        self,
        op: Any,
        inputs: list[Tensor],
        used: list[Tensor],
        outputs: list[Tensor],
        result: Any,
        attrs: dict[str, Any],
    ) -> None:
        super().on_op(op, inputs, used, outputs, result, attrs)
        index = len(self.op_parts)
        part = self.current
        if self.tensor_parts and hooks.current_phase() == "optimizer":
            # Work on gradients before the updates (global-norm clipping) serves their parameters.
            known = next((self.tensor_parts[id(t)][0] for t in inputs if id(t) in self.tensor_parts), None)
            if known is not None:
                part = known
                for t in outputs:
                    self.tensor_parts[id(t)] = (part, t)
        self.op_parts.append(part)
        weight = False
        for t in inputs:
            param = _parameter_behind(t)
            if param is not None:
                weight = True
                if hooks.current_phase() == "forward":
                    self.param_parts.setdefault(id(param), self.current)
        if weight and op.name == "matmul" and hooks.current_phase() == "forward":
            self.weight_ops.add(index)
        for t in (*outputs, *used):
            if t._grad_fn is not None:
                self.node_parts.setdefault(id(t._grad_fn), part)


def _parameter_behind(t: Tensor) -> Parameter | None:
    """``t`` itself if a parameter, or the parameter a ZeRO-3 gathered copy was made from."""
    if isinstance(t, Parameter):
        return t
    note = t._regather
    if note is not None and isinstance(note[0], Parameter):
        return note[0]
    return None


def _labelled(rec: _Recorder, part: Part, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        rec.current = part  # stays set after: the leaf gradients it produces are reduced next
        return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------- the trace
def build_meshes(strategy: GPTStrategy) -> list[ProcessMesh]:
    """Stage meshes: pipeline rank k holds ranks ``k*dp*tp ..`` as (dp, tp); stage s is on rank ``s mod pp``."""
    lanes = GPTParallel.from_degrees(strategy.dp, strategy.tp, strategy.pp).stage_meshes
    return [lanes[s % strategy.pp] for s in range(strategy.num_stages)]


def trace_gpt_step(shape: GPTShape, strategy: GPTStrategy, layers_traced: int | None = None) -> StepTrace:
    """Trace one micro-batch's forward and backward and one optimizer step, shape-only (module docstring).

    ``layers_traced``: how many transformer layers the traced model has (default: two per
    stage, or all when a stage has only one; ``shape.layers`` traces the whole model).
    """
    import time

    started = time.perf_counter()
    stages = strategy.num_stages
    if shape.layers < stages:
        raise ValueError(
            f"GPT layers ({shape.layers}) < pipeline stages pp({strategy.pp}) * chunks({strategy.chunks}) = {stages}; "
            "every stage needs at least one layer"
        )
    real = [0] * stages
    for i in range(shape.layers):
        real[GPTParallel(build_meshes(strategy)).stage_of_layer(i, shape.layers)] += 1
    default = 2 * stages if min(real) >= 2 else shape.layers
    traced = default if layers_traced is None else layers_traced
    if not stages <= traced <= shape.layers:
        raise ValueError(
            f"layers_traced must be between the stages ({stages}) and the layers ({shape.layers}), got {traced}"
        )
    meshes = build_meshes(strategy)
    par = GPTParallel(meshes, sequence_parallel=strategy.sequence_parallel, recompute=strategy.recompute)
    cfg = GPTConfig(
        vocab_size=shape.vocab,
        block_size=shape.seq,
        n_layer=traced,
        n_head=shape.heads,
        n_embd=shape.hidden,
        dropout=shape.dropout,
        dtype=strategy.dtype,
    )
    meta = {"shape_only": True, "model": f"GPT {shape}", "strategy": str(strategy), "layers_traced": traced}
    rec = _Recorder(meta)
    with dist.use_backend(ShapeOnlyBackend()), np.errstate(over="ignore"):  # the -1e9 causal mask in float16
        model = GPT(cfg, par)
        opt = _optimizer(model, strategy)
        block_io: dict[int, dict[str, Tensor]] = {}
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(functools.partial(_enter_block, rec, block_io, i))
            block.register_forward_post_hook(functools.partial(_leave_block, rec, block_io, i, traced))
        batch = shape.micro_batch_size * strategy.dp
        first, last = meshes[0], meshes[-1]
        idx = dist.shard_tensor(
            Tensor.abstract((batch, shape.seq), np.int64), first, par.activation(first, seq_split=False)
        )
        tgt = dist.shard_tensor(
            Tensor.abstract((batch, shape.seq), np.int64), last, par.activation(last, seq_split=False)
        )
        synced: set[int] = set()
        params = list(model.parameters())
        for p in params:
            p.register_hook(lambda g: synced.add(id(g)))  # the gradient as it lands, after its reshard
        with rec:
            loss = model.loss(idx, tgt)
            nodes = _topo_order(loss)
            node_part = _node_parts(rec, nodes, block_io)
            activations, layer_kept = _activations(nodes, node_part, params, meshes)
            for node in nodes:
                _label_backward(rec, node, node_part[id(node)])
            rec.current = LAST
            loss.backward()
            rec.current = SETUP
            opt.step()  # creates the states (and float32 masters)
            step_param = opt._step_param

            def labelled_step(p: Tensor, g: Tensor, lr: float) -> None:
                rec.current = rec.param_parts.get(id(p), LAST)
                step_param(p, g, lr)

            opt._step_param = labelled_step  # type: ignore[method-assign]
            rec.tensor_parts = {
                id(p.grad): (rec.param_parts.get(id(p), LAST), p.grad) for p in params if p.grad is not None
            }
            opt.step()  # the steady-state update: this one is priced
        grad_sync = {i for i, out in rec.reshard_outs if id(out) in synced and rec.reshard_parts[i] != SETUP}
        parts = {id(p): rec.param_parts.get(id(p), LAST) for p in params}
        model_state, update_elements, per_element = _model_state(params, opt, parts, strategy)
        records = _state_records(params, opt, parts)
        counts: dict[Part, int] = {}
        for p in params:
            counts[parts[id(p)]] = counts.get(parts[id(p)], 0) + 1
    plan = rec.plan()
    return StepTrace(
        shape,
        strategy,
        plan,
        [tuple(m.process_ids) for m in meshes],
        [par.stage_of_layer(i, traced) for i in range(traced)],
        rec.op_parts,
        rec.reshard_parts,
        grad_sync,
        rec.weight_ops,
        activations,
        model_state,
        update_elements,
        counts,
        per_element,
        layer_kept,
        time.perf_counter() - started,
        records,
    )


def _optimizer(model: GPT, strategy: GPTStrategy) -> Any:
    mp = strategy.mixed_precision
    clip = dist.optimizer.ClipGradByGlobalNorm(strategy.grad_clip) if strategy.grad_clip is not None else None
    if strategy.optimizer == "adamw":
        opt = dist.optimizer.AdamW(
            learning_rate=1e-4, parameters=model.parameters(), weight_decay=0.01, grad_clip=clip, multi_precision=mp
        )
    else:
        opt = dist.optimizer.Momentum(
            learning_rate=1e-4, parameters=model.parameters(), momentum=0.9, grad_clip=clip, multi_precision=mp
        )
    if strategy.zero:
        stage = [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][strategy.zero - 1]
        opt = dist.shard_optimizer(opt, stage("dp"))
    return opt


def _enter_block(rec: _Recorder, io: dict[int, dict[str, Tensor]], i: int, layer: Any, args: tuple[Any, ...]) -> None:
    if hooks.current_phase() != "forward":  # a recomputation in backward: its node labels it
        return
    rec.current = Part("layer", i)
    x = args[0]
    io[i] = {"input": x}
    node = x._grad_fn
    if i > 0 and node is not None and node.op == "reshard":
        rec.node_parts[id(node)] = Part("handoff", i)


def _leave_block(
    rec: _Recorder, io: dict[int, dict[str, Tensor]], i: int, blocks: int, layer: Any, args: Any, result: Any
) -> None:
    if hooks.current_phase() != "forward":
        return
    io[i]["output"] = result
    rec.current = LAST if i == blocks - 1 else Part("handoff", i + 1)


def _node_parts(rec: _Recorder, nodes: list[Node], block_io: dict[int, dict[str, Tensor]]) -> dict[int, Part]:
    """Each tape node's part: the block whose output it leads to (back to the block's input), else its recorder label."""
    parts = {id(n): rec.node_parts.get(id(n), LAST) for n in nodes}
    for i, io in block_io.items():
        out = io["output"]
        stop = io["input"]
        stack = [out._grad_fn] if out._grad_fn is not None else []
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            parts[id(node)] = Part("layer", i)
            for p in node.parents:
                if p is not None and p is not stop and p._grad_fn is not None:
                    stack.append(p._grad_fn)
    return parts


def _label_backward(rec: _Recorder, node: Node, part: Part) -> None:
    """Backward work of ``node`` (its gradient function, re-gathering its notes) is labelled ``part``."""
    node.grad_fn = _labelled(rec, part, node.grad_fn)
    for value in (*node.ctx.inputs, *node.ctx.outputs):
        if isinstance(value, Packed):
            value.unpack = _labelled(rec, part, value.unpack)


def _rank_bytes(t: Tensor, world: tuple[int, ...]) -> dict[int, int]:
    size = np.dtype(t.dtype).itemsize
    if not t.is_dist:
        n = math.prod(t.shape) * size
        return dict.fromkeys(world, n)
    return _spec_rank_bytes(t.spec, size)


@functools.lru_cache(maxsize=4096)
def _spec_rank_bytes(spec: DistSpec, itemsize: int) -> dict[int, int]:
    """Bytes per rank of one layout (callers only read it): a trace asks for the same few layouts
    hundreds of times, each over every rank of the mesh."""
    return {r: math.prod(shape) * itemsize for r, shape in zip(spec.mesh.process_ids, spec.local_shapes, strict=True)}


def _add(into: dict[int, int], more: dict[int, int]) -> None:
    for r, n in more.items():
        into[r] = into.get(r, 0) + n


def _activations(
    nodes: list[Node], node_part: dict[int, Part], params: list[Parameter], meshes: list[ProcessMesh]
) -> tuple[dict[Part, dict[int, int]], list[KeptTensor]]:
    world = tuple(sorted({r for m in meshes for r in m.process_ids}))
    seen = {p._sid for p in params}
    out: dict[Part, dict[int, int]] = {}
    first_rank = meshes[0].process_ids[0]
    layer0: list[KeptTensor] = []
    for node in nodes:
        part = node_part[id(node)]
        for role, t in kept_items(node):
            if t._sid in seen:
                continue
            seen.add(t._sid)
            per_rank = _rank_bytes(t, world)
            _add(out.setdefault(part, {}), per_rank)
            if part == Part("layer", 0):
                local = t.spec.local_shape(first_rank) if t.is_dist else tuple(t.shape)
                layer0.append(KeptTensor(node.op, role, str(t.dtype), tuple(local), per_rank.get(first_rank, 0)))
    return out, layer0


UPDATE_STATES = {"adamw": 2, "momentum": 1}


def _state_records(params: list[Parameter], opt: Any, parts: dict[int, Part]) -> list[StateRecord]:
    """``_model_state``'s inputs as layouts, one record per parameter (same names, same categories)."""
    states: dict[str, list[Tensor]] = {}
    for key, t in opt.state_tensors().items():
        states.setdefault(re.sub(r"\.[^.]+$", "", key), []).append(t)
    out = []
    for i, p in enumerate(params):
        if not p.is_dist:
            raise ValueError(f"parameter {p.name or i} is dense; the GPT trace lays out every parameter")
        entries = [("parameters", np.dtype(p.dtype).itemsize, p.spec.placements_str)]
        if p.grad is not None:
            entries.append(("gradients", np.dtype(p.grad.dtype).itemsize, p.grad.spec.placements_str))
        for t in states.get(p.name or f"param_{i}", []):
            entries.append(("optimizer_state", np.dtype(t.dtype).itemsize, t.spec.placements_str))
            if tuple(t.shape) != tuple(p.shape) or t.spec.mesh != p.spec.mesh:
                raise ValueError(
                    f"optimizer state of {p.name} has shape {t.shape} on {t.spec.mesh}, not its parameter's"
                )
        layout = opt.layout_of(p)
        out.append(
            StateRecord(
                parts[id(p)],
                tuple(p.spec.mesh.process_ids),
                tuple(p.shape),
                tuple(entries),
                layout.placements_str if layout is not None else None,
            )
        )
    return out


def _model_state(
    params: list[Parameter], opt: Any, parts: dict[int, Part], strategy: GPTStrategy
) -> tuple[dict[Part, dict[str, dict[int, int]]], dict[Part, dict[int, int]], float]:
    world = tuple(sorted({r for p in params if p.is_dist for r in p.spec.mesh.process_ids}))
    state: dict[Part, dict[str, dict[int, int]]] = {}
    updates: dict[Part, dict[int, int]] = {}
    by_name: dict[str, Part] = {}
    for i, p in enumerate(params):
        part = parts[id(p)]
        cats = state.setdefault(part, {"parameters": {}, "gradients": {}, "optimizer_state": {}})
        _add(cats["parameters"], _rank_bytes(p, world))
        if p.grad is not None:
            _add(cats["gradients"], _rank_bytes(p.grad, world))
        layout = opt.layout_of(p)
        elems = (
            {r: math.prod(layout.local_shape(r)) for r in layout.mesh.process_ids}
            if layout is not None
            else dict.fromkeys(world, math.prod(p.shape))
        )
        _add(updates.setdefault(part, {}), elems)
        by_name[p.name or f"param_{i}"] = part
    for key, t in opt.state_tensors().items():
        name = re.sub(r"\.[^.]+$", "", key)
        _add(state[by_name[name]]["optimizer_state"], _rank_bytes(t, world))
    # Per updated element: read parameter, gradient and states (with the master), write them back.
    p_bytes = 2 if strategy.mixed_precision else 4
    s_bytes = 4 * (UPDATE_STATES[strategy.optimizer] + (1 if strategy.mixed_precision else 0))
    return state, updates, 2.0 * (2 * p_bytes + s_bytes)
