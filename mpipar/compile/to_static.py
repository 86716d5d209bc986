"""``dist.to_static``: a training step compiled into a Plan and run by stage and micro-batch.

    strategy = dist.Strategy()
    strategy.pipeline.enable = True
    strategy.pipeline.schedule_mode = "1F1B"        # FThenB, 1F1B, Interleaved1F1B, ZBH1
    strategy.pipeline.accumulate_steps = 4          # micro-batches per step
    dist_model = dist.to_static(model, loader, loss_fn, optimizer, strategy)
    for x, y in loader():
        loss = dist_model(x, y)                     # one step: forward, backward, update
    dist_model.plan                                 # mpipar.compile.plan.Plan of the step

``dist.Strategy(auto=True)``: on the first step the simulator's estimator chooses the pipeline
schedule and micro-batch count for the model's own layout and the batch (a ``mpipar.models.gpt.GPT``;
through the ``mpipar.strategy_search`` entry point), as if they had been set by hand.

The first call probes the step with every op in shape-only mode: the pipeline stages (runs of
ops on one mesh between cross-mesh reshards, seed 000 §4.3/4.4), the transfers between them
and the plan (``mpipar.plan``: ops with their rule decisions, every reshard with its bytes,
forward and backward, the stages and the schedule's per-rank actions). Each call then cuts the
batch into micro-batches (locally, per data-parallel shard) and runs the schedule
(``mpipar.pipeline.runner``): in the simulator all actions in one dependency-respecting
order, under MPI each process its own pipeline rank's list. After the first step's update the
plan also holds the gradients and the optimizer's states (their layouts, as an eager plan). Without a pipeline a step is the
eager forward, backward and update, which is what the plan describes.

Every training step after the first replays the first one's per-op decisions (rules, reshard
targets, output layouts: ``mpipar.replay``); a batch of another shape or layout, or a parameter
moved to another placement, records them again. Results are the eager step's, bit for bit.
``to_static(..., capture=True)`` goes further: a captured program of the step's array work
(``mpipar.capture``), still bit for bit.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import numpy as np

from mpipar import autograd, hooks
from mpipar import random as _random
from mpipar.backend import current_backend
from mpipar.compile.plan import Plan
from mpipar.compile.program import StepPrograms
from mpipar.compile.replay import CompiledStep
from mpipar.compile.trace import PlanRecorder
from mpipar.distribute import shard_tensor
from mpipar.nn.layer import Layer
from mpipar.ops.math import add, ones_like_global, scale
from mpipar.optimizer.optimizer import Optimizer
from mpipar.parallel import ShardingStage1, ShardingStage2, ShardingStage3, shard_optimizer
from mpipar.pipeline.runner import PipelineRunner, Probe, batch_parts, probe
from mpipar.pipeline.schedule import Schedule, build_schedule
from mpipar.placement import Replicate
from mpipar.runtime.log import print_once
from mpipar.tensor import Tensor


class _Section:
    """One section of a ``Strategy``: its keys are attributes (Paddle's ``strategy.pipeline.enable``)."""

    def __init__(self, **defaults: Any) -> None:
        self.__dict__.update(defaults)

    if TYPE_CHECKING:  # keys are set per section at run time; the type checker sees any name

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class Strategy:
    """Paddle's ``dist.Strategy``: ``pipeline``, ``sharding``, ``gradient_merge``, ``recompute`` and
    ``amp`` sections (``to_static`` applies the first three; the ``Engine`` all, refusing amp).
    ``auto=True``: ``to_static`` chooses the pipeline schedule and micro-batches itself (module doc)."""

    _SECTIONS = ("pipeline", "sharding", "gradient_merge", "recompute", "amp")

    def __init__(self, config: dict[str, dict[str, Any]] | None = None, *, auto: bool = False) -> None:
        if not isinstance(auto, bool):
            raise TypeError(f"Strategy auto must be True or False, got {auto!r}")
        self.auto = auto
        self.pipeline = _Section(
            enable=False, schedule_mode="1F1B", accumulate_steps=1, micro_batch_size=None, vpp_degree=1
        )
        self.sharding = _Section(enable=False, stage=1, degree=None, mesh_dim="dp")
        self.gradient_merge = _Section(enable=False, k_steps=1, avg=True)
        # Read by the Engine (mpipar.compile.engine), which applies recompute and refuses amp by name.
        self.recompute = _Section(enable=False, checkpoints=None, no_recompute_segments=[])
        self.amp = _Section(enable=False, dtype="float16", level="o1", init_loss_scaling=32768.0)
        for section, values in (config or {}).items():
            target = getattr(self, section, None) if section in self._SECTIONS else None
            if target is None:
                raise ValueError(f"Strategy has no section {section!r}; sections: {', '.join(self._SECTIONS)}")
            target.__dict__.update(values)

    def __repr__(self) -> str:
        auto = ", auto=True" if self.auto else ""
        return (
            f"Strategy(pipeline={self.pipeline}, sharding={self.sharding}, gradient_merge={self.gradient_merge}, "
            f"recompute={self.recompute}, amp={self.amp}{auto})"
        )


def _positional_arity(fn: Callable[..., Any], required: bool = False) -> int | None:
    """How many positional arguments ``fn`` takes (only those without a default when ``required``);
    None when it takes ``*args`` or has no readable signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return len([p for p in positional if p.default is p.empty]) if required else len(positional)


class DistModel:
    """What ``to_static`` returns: call it with a batch to run one step (see the module doc)."""

    def __init__(
        self,
        layer: Layer,
        loader: Any,
        loss: Callable[..., Tensor] | None,
        optimizer: Optimizer | None,
        strategy: Strategy | None,
        capture: bool = False,
    ) -> None:
        self.layer, self.loader, self.loss_fn = layer, loader, loss
        self.strategy = strategy or Strategy()
        if optimizer is not None and self.strategy.sharding.enable:
            stage = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}[int(self.strategy.sharding.stage)]
            optimizer = shard_optimizer(optimizer, stage(self.strategy.sharding.mesh_dim))
        self.optimizer = optimizer
        self.mode = "train"
        self._probe: Probe | None = None
        self._schedule: Schedule | None = None
        self._plan: Plan | None = None
        self._recorder: PlanRecorder | None = None
        """The probe's recorder, until the first update adds the optimizer's states to the plan."""
        self.auto_choice: Any = None
        """With ``Strategy(auto=True)``, after the first step: the search's pick (``report()`` says it)."""
        self.replay: CompiledStep[Tensor] = CompiledStep(self._train_step, capture=capture)
        """The training step, replayed after its first call (``mpipar.replay``): ``.retraces``
        counts the steps that recorded their decisions (the first, and each change of layout).
        With ``capture=True`` a captured program of the step runs once two traced steps agree
        (``mpipar.capture``; ``.captured``, ``.capture_refused``)."""

    # ------------------------------------------------------------------ modes
    def train(self) -> DistModel:
        self.mode = "train"
        self.layer.train()
        return self

    def eval(self) -> DistModel:
        self.mode = "eval"
        self.layer.eval()
        return self

    def predict(self) -> DistModel:
        self.mode = "predict"
        self.layer.eval()
        return self

    @property
    def microbatches(self) -> int:
        pipe, merge = self.strategy.pipeline, self.strategy.gradient_merge
        if pipe.enable:
            return int(pipe.accumulate_steps)
        return int(merge.k_steps) if merge.enable else 1

    # ------------------------------------------------------------------ the step
    def _loss(self, batch: Sequence[Tensor]) -> Tensor:
        if self.loss_fn is None:
            raise ValueError("to_static: training needs a loss function (to_static(layer, loader, loss, optimizer))")
        n_inputs = _positional_arity(self.layer.forward)
        if n_inputs is None or n_inputs >= len(batch):
            *inputs, label = batch
            labels = [label]
        else:  # the model takes the first n_inputs fields; the rest are labels
            inputs, labels = list(batch[:n_inputs]), list(batch[n_inputs:])
        out = self.layer(*inputs)
        takes = _positional_arity(self.loss_fn, required=True)
        # A loss of the output alone (seed 000's ``paddle.mean``) is called with it alone, as Paddle does.
        return self.loss_fn(out) if takes == 1 else self.loss_fn(out, *labels)

    def _prepare(self, batch: Sequence[Tensor]) -> None:
        if self._probe is not None:
            return
        if self.strategy.auto:
            self._choose_pipeline(batch)
        m = self.microbatches
        first = batch_parts(batch, m)[0]
        for name, p in self.layer.named_parameters():
            p.name = p.name or name
        params = self.layer.parameters()
        saved_grads = [p.grad for p in params]
        recorder = PlanRecorder({"kind": "to_static", "microbatches": m, "backend": current_backend().name})
        with recorder:
            for p in params:
                recorder.mark(p, "parameter", p.name)
            # One micro-batch, every op on shapes only: the stages, and forward + backward for the plan.
            self._probe, loss = probe(lambda: self._loss(first), with_grad=True)
            if isinstance(loss, Tensor) and not loss.stop_gradient:
                with hooks.phase("backward"):
                    autograd.run_backward([loss], [ones_like_global(loss)])
        # A dense parameter belongs to the stage whose op used it: replicate it on that mesh, so
        # its gradient stays among that stage's ranks (a dense gradient would need every process).
        for p, mesh in self._probe.dense_params:
            shard_tensor(p, mesh, [Replicate()] * mesh.ndim)
        self._grad_params = [p for p in params if p.grad is not None]
        for p, g in zip(params, saved_grads, strict=True):  # drop the probe's shape-only gradients
            p.grad = g
        self._loss_spec = loss.spec if isinstance(loss, Tensor) and loss.is_dist else None
        self._loss_dtype = loss.dtype if isinstance(loss, Tensor) else None
        pipe = self.strategy.pipeline
        stages = self._probe.num_stages
        if pipe.enable or stages > 1:
            kind = pipe.schedule_mode if pipe.enable else "FThenB"
            chunks = self._chunks(int(pipe.vpp_degree)) if kind.lower().startswith("interleaved") else 1
            self._schedule = build_schedule(kind, stages, m, num_chunks=chunks)
        recorder.pipeline = {
            "stages": [{"stage": s, "mesh": recorder._mesh_id(mesh)} for s, mesh in enumerate(self._probe.meshes)],
            "num_microbatches": m,
            "schedule": self._schedule.to_dict() if self._schedule is not None else None,
        }
        self._plan = recorder.plan()
        self._recorder = recorder

    def _choose_pipeline(self, batch: Sequence[Tensor]) -> None:
        """``Strategy(auto=True)``: the search picks schedule and micro-batches for this model and
        batch. Under MPI rank 0 decides and broadcasts, so every rank runs the same schedule; the
        generator's state is kept, so the step draws what it would with those settings given."""
        found = list(entry_points(group="mpipar.strategy_search"))
        if not found:
            raise RuntimeError(
                "Strategy(auto=True) needs the simulator's search (pip install -e . registers "
                "simulator.auto:choose_pipeline under the 'mpipar.strategy_search' entry point)"
            )
        if not batch or not hasattr(batch[0], "shape") or not batch[0].shape:
            raise ValueError("Strategy(auto=True): the first step's batch must be tensors with a batch dimension")
        backend = current_backend()
        kinds = ("FThenB", "1F1B", "ZBH1", "Interleaved1F1B")
        saved = _random.get_rng_state()
        choice, failure = None, None
        if backend.name != "mpi" or backend.rank == 0:
            try:
                choice = found[0].load()(
                    self.layer, int(batch[0].shape[0]), backend.world_size, lambda line: print_once(line, flush=True)
                )
            except ValueError as exc:
                failure = exc
        _random.set_rng_state(saved)
        code = np.array(
            [-1, 0] if choice is None else [kinds.index(choice.schedule), choice.micro_batches], dtype=np.int64
        )
        if backend.name == "mpi":
            world = tuple(range(backend.world_size))
            code = backend.comm.broadcast(world, {backend.rank: code}, 0, (2,), np.int64)[backend.rank]
        if failure is not None:
            raise failure
        if code[0] < 0:
            raise ValueError("Strategy(auto=True): rank 0's search failed (its error is in rank 0's output)")
        if choice is not None:
            print_once(choice.report(), flush=True)
            self.auto_choice = choice
        pipe = self.strategy.pipeline
        pipe.enable, pipe.schedule_mode, pipe.accumulate_steps = True, kinds[int(code[0])], int(code[1])

    def _chunks(self, requested: int) -> int:
        """Virtual stages per pipeline rank, read off the model: stage s must live on mesh s mod p."""
        assert self._probe is not None
        meshes = self._probe.meshes
        distinct: list[Any] = []
        for mesh in meshes:
            if not any(mesh.same_layout(d) for d in distinct):
                distinct.append(mesh)
        p = len(distinct)
        if len(meshes) % p or any(not meshes[s].same_layout(distinct[s % p]) for s in range(len(meshes))):
            raise ValueError(
                f"Interleaved1F1B needs stage s on pipeline mesh s mod p; the model's {len(meshes)} stages run on "
                f"{[m.process_ids for m in meshes]}"
            )
        chunks = len(meshes) // p
        if requested > 1 and requested != chunks:
            raise ValueError(
                f"strategy.pipeline.vpp_degree = {requested}, but the model places {len(meshes)} stages on {p} "
                f"meshes ({chunks} per mesh); build the model with {requested} chunks per mesh"
            )
        return chunks

    def __call__(self, *batch: Tensor) -> Tensor:
        # A batch passed as one list (``dist_model(inputs)`` with a loader's [x, y]) is its fields, as in Paddle.
        batch = tuple(f for b in batch for f in (b if isinstance(b, (list, tuple)) else [b]))
        if self.mode != "train":
            with autograd.no_grad():
                return self._loss(batch) if self.mode == "eval" else self.layer(*batch)
        self._prepare(batch)
        return self.replay(*batch)

    def _train_step(self, *batch: Tensor) -> Tensor:
        """One training step (replayed by ``self.replay`` after the first)."""
        assert self._probe is not None
        m = self.microbatches
        parts = batch_parts(batch, m)
        if self._schedule is None:
            losses = []
            for part in parts:
                loss = self._loss(part)
                (scale(loss, 1.0 / m) if m > 1 else loss).backward()
                losses.append(loss)
        else:
            runner = PipelineRunner(self._schedule, self._probe, lambda i: self._loss(parts[i]), self._grad_params)
            losses = runner.step()
        if self.optimizer is not None:
            self.optimizer.step()
            recorder = self._recorder
            if recorder is not None:
                # The probe ran no update: the first step's gradients (before they are cleared)
                # and the optimizer's states, which exist from now on, join the plan, as an
                # eager script's plan has them.
                recorder.mark_optimizer(self.optimizer)
                self._plan, self._recorder = recorder.plan(), None
            self.optimizer.clear_grad()
        return self._mean(losses)

    def _mean(self, losses: list[Tensor]) -> Tensor:
        with autograd.no_grad():
            if not losses:
                # This process holds no rank of the last stage (MPI): an empty tensor of the loss's
                # layout, so that float(loss) -- a collective -- still takes part.
                if self._loss_spec is None:
                    raise RuntimeError("to_static: the loss is not a distributed tensor, yet no stage computed it here")
                return Tensor._from_shards(self._loss_spec, {}, self._loss_dtype)
            total = losses[0]
            for loss in losses[1:]:
                total = add(total, loss)
            return scale(total, 1.0 / len(losses)) if len(losses) > 1 else total

    # ------------------------------------------------------------------ inspection
    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise ValueError("DistModel.plan: call the model once (a training step) to trace it")
        return self._plan

    @property
    def schedule(self) -> Schedule | None:
        return self._schedule

    @property
    def _engine(self) -> StepPrograms:
        """The step's programs, as Paddle's ``dist_model._engine`` shows them (seed 003 prints and
        draws ``dist_model._engine.main_program``). Before the first step, the step is traced on
        the loader's first batch, read with every random generator put back afterwards, so the
        training loop still draws the same batches."""
        return StepPrograms(self._plan_for_view)

    def _plan_for_view(self) -> Plan:
        if self._plan is None:
            if self.loader is None:
                raise ValueError("DistModel: no program yet; run a step, or pass to_static the loader")
            np_state, own_state = np.random.get_state(), _random.get_rng_state()
            try:
                first = next(iter(self.loader() if callable(self.loader) else self.loader))
            finally:
                np.random.set_state(np_state)
                _random.set_rng_state(own_state)
            fields = tuple(first) if isinstance(first, (list, tuple)) else (first,)
            self._prepare(fields)
        assert self._plan is not None
        return self._plan

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.layer.state_dict()}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        return out


def to_static(
    layer: Layer,
    loader: Any = None,
    loss: Callable[..., Tensor] | None = None,
    optimizer: Optimizer | None = None,
    strategy: Strategy | None = None,
    capture: bool = False,
) -> DistModel:
    """Paddle's ``dist.to_static(layer, loader, loss, optimizer, strategy)`` (see the module doc).

    ``capture=True``: training steps run as a captured program once two traced steps agree
    (``mpipar.capture``; a pipeline schedule or any step it cannot reproduce is refused and
    runs as before)."""
    if not isinstance(layer, Layer):
        raise TypeError(f"to_static needs a dist.nn.Layer, got {type(layer).__name__}")
    return DistModel(layer, loader, loss, optimizer, strategy, capture=bool(capture))
