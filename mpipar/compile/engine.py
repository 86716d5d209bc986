"""Paddle's auto-parallel ``Engine``: a model, loss, optimizer and metrics trained by plan.

    engine = Engine(model, loss_fn, optimizer, paddle.metric.Accuracy(topk=(1, 5)), strategy=strategy)
    engine.prepare(inputs_spec=InputSpec([None, 256], "float32", "img"),
                   labels_spec=InputSpec([None], "int64", "label"), mode="train")
    loader = engine.dataloader(dataset, batch_size=32, epochs=5, mode="train")
    for data in loader():
        outs = engine.run(data, mode="train")        # {"loss": ..., "acc_top1": ..., "acc_top5": ...}
    engine.fit(dataset, epochs=5, batch_size=32)     # or Paddle's fit / evaluate / predict

Built on ``dist.to_static``: ``run`` is one ``DistModel`` step (traced once into a plan,
replayed after), so an Engine computes what the eager step computes. What the Engine adds is
Paddle's:

* **data parallel by default.** A model that places nothing on a mesh (no ``shard_tensor``,
  ``shard_op`` or ``ProcessMesh`` in its forward: checked by tracing its forward once, shape
  only) is trained data parallel over every rank: parameters replicated on a ``dp`` mesh of
  the world, each batch split ``Shard(0)``. A model that places itself runs as placed.
* **the strategy's keys**, applied or refused by name: ``sharding`` (``enable``, ``stage``
  1/2/3, ``degree`` = the data-parallel size) is ZeRO over the ``dp`` axis; ``recompute``
  recomputes each direct sub-layer in backward; ``gradient_merge`` (``k_steps``, ``avg``)
  splits a batch into k micro-batches with one update; ``pipeline`` (``enable``,
  ``schedule_mode``, ``micro_batch_size``, ``accumulate_steps``) runs the stages the model's
  ``shard_op`` placed, by schedule; ``amp`` is refused (no auto-cast in mpipar).
* **metrics**: each ``paddle.metric`` object's ``compute``/``update`` runs on the step's
  predictions and labels (gathered: every rank takes part), and ``run`` returns the
  accumulated values under the metric's names. With a pipeline, as in Paddle, ``"loss"`` is a
  list of the micro-batches' losses and only processes holding the last stage see it (and
  the metrics); ``engine.last_loss`` is the step's mean loss on every process.
* **programs**: ``serial_main_program`` (the step on one device, placements as annotations)
  and ``main_program`` (this rank's ops, local shapes and inserted communication) print as
  Paddle's programs do and draw through ``mpipar.base`` (``IrGraph(core.Graph(p.desc))``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpipar import autograd
from mpipar.backend import current_backend
from mpipar.checkpoint import load_state_dict, save_state_dict
from mpipar.compile.plan import Plan
from mpipar.compile.program import InputSpec, PlanProgram, StepPrograms
from mpipar.compile.to_static import DistModel, Strategy
from mpipar.compile.trace import PlanRecorder
from mpipar.distribute import shard_tensor
from mpipar.io import BatchSampler, DataLoader, Dataset
from mpipar.mesh import ProcessMesh
from mpipar.nn.layer import Layer
from mpipar.placement import Replicate, Shard
from mpipar.recompute import recompute
from mpipar.runtime.log import print_once
from mpipar.tensor import Tensor

MODES = ("train", "eval", "predict")


def _check_mode(mode: str | None, default: str) -> str:
    mode = default if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"Engine: mode must be one of {list(MODES)}, got {mode!r}")
    return mode


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def check_strategy(strategy: Strategy) -> None:
    """Refuse, by name, what the Engine cannot apply (before anything is built)."""
    amp = strategy.amp
    if amp.enable:
        raise ValueError(
            f"Strategy.amp.enable = True (dtype {amp.dtype!r}, level {amp.level!r}) is not supported: mpipar has no "
            "auto-cast. Train in a 16-bit dtype instead: paddle.set_default_dtype('float16' or 'bfloat16') and an "
            "optimizer with multi_precision=True (float32 master weights)"
        )
    gm = strategy.gradient_merge
    if gm.enable and not gm.avg:
        raise ValueError(
            "Strategy.gradient_merge.avg = False (summed micro-batch gradients) is not supported; use avg=True"
        )
    if gm.enable and int(gm.k_steps) < 1:
        raise ValueError(f"Strategy.gradient_merge.k_steps must be >= 1, got {gm.k_steps!r}")
    if gm.enable and strategy.pipeline.enable:
        raise ValueError(
            "Strategy: gradient_merge and pipeline both split the batch; enable one (pipeline.accumulate_steps)"
        )
    sh = strategy.sharding
    if sh.enable and int(sh.stage) not in (1, 2, 3):
        raise ValueError(f"Strategy.sharding.stage must be 1, 2 or 3, got {sh.stage!r}")
    pp = strategy.pipeline
    if pp.enable and int(pp.accumulate_steps) < 1:
        raise ValueError(f"Strategy.pipeline.accumulate_steps must be >= 1, got {pp.accumulate_steps!r}")


class _EngineLoader:
    """What ``Engine.dataloader`` returns: call it (or iterate it) for one epoch of global batches."""

    def __init__(self, loader: DataLoader, steps_per_epoch: int | None, epochs: int) -> None:
        self.loader, self.steps_per_epoch, self.epochs = loader, steps_per_epoch, epochs

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader()):
            if self.steps_per_epoch is not None and i >= self.steps_per_epoch:
                return
            yield batch

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __len__(self) -> int:
        n = len(self.loader)
        return n if self.steps_per_epoch is None else min(n, self.steps_per_epoch)


class Engine:
    """Paddle's ``paddle.distributed.auto_parallel.Engine`` (see the module docstring)."""

    def __init__(
        self,
        model: Layer | None = None,
        loss: Callable[..., Tensor] | None = None,
        optimizer: Any = None,
        metrics: Any = None,
        cluster: Any = None,
        strategy: Strategy | None = None,
    ) -> None:
        if model is not None and not isinstance(model, Layer):
            raise TypeError(f"Engine: model must be a paddle.nn.Layer, got {type(model).__name__}")
        if loss is not None and not callable(loss):
            raise TypeError(
                f"Engine: loss must be callable (a paddle.nn loss layer or function), got {type(loss).__name__}"
            )
        if cluster is not None:
            raise ValueError(
                "Engine: cluster= is not supported; the world is the launch's (mpiexec -n N, or the simulator)"
            )
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(f"Engine: strategy must be a paddle.distributed.Strategy, got {type(strategy).__name__}")
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.metrics = _as_list(metrics)
        for m in self.metrics:
            for need in ("compute", "update", "accumulate", "reset", "name"):
                if not callable(getattr(m, need, None)):
                    raise TypeError(f"Engine: metric {m!r} has no {need}() (a paddle.metric.Metric is expected)")
        self.strategy = strategy or Strategy()
        check_strategy(self.strategy)
        self._inputs_spec: list[InputSpec] = []
        self._labels_spec: list[InputSpec] = []
        self._mode = "train"
        self._dist_model: DistModel | None = None
        self._dp_mesh: ProcessMesh | None = None
        self._placed: bool | None = None
        self._stash: list[tuple[Tensor, Tensor]] = []
        self._probe_out: tuple[Any, tuple[int, ...], Any, Any] | None = None
        self._batch_hint: int | None = None
        self._serial_plan: Plan | None = None
        self.last_loss: float | None = None
        """The last training or evaluation step's mean loss, on every process."""
        self.history: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ preparation
    def prepare(
        self,
        inputs_spec: Any = None,
        labels_spec: Any = None,
        inputs: Any = None,
        labels: Any = None,
        main_program: Any = None,
        startup_program: Any = None,
        mode: str | None = None,
        init_parameters: bool = True,
    ) -> None:
        """Record the inputs' and labels' specs (``InputSpec``); the step is traced with them on
        first use (a printed program, or the first ``run``)."""
        if main_program is not None or startup_program is not None:
            raise ValueError(
                "Engine.prepare: main_program/startup_program are not supported; the Engine builds its own"
            )
        if inputs is not None or labels is not None:
            raise ValueError(
                "Engine.prepare: inputs=/labels= (static variables) are not supported; pass inputs_spec/labels_spec"
            )
        self._mode = _check_mode(mode, self._mode)
        for name, specs in (("inputs_spec", inputs_spec), ("labels_spec", labels_spec)):
            for s in _as_list(specs):
                if not isinstance(s, InputSpec):
                    raise TypeError(
                        f"Engine.prepare: {name} must be paddle.static.InputSpec objects, got {type(s).__name__}"
                    )
        self._inputs_spec = _as_list(inputs_spec)
        self._labels_spec = _as_list(labels_spec)

    def dataloader(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[..., Any] | None = None,
        num_workers: int = 0,
        use_buffer_reader: bool = True,
        use_shared_memory: bool = True,
        timeout: int = 0,
        worker_init_fn: Callable[..., Any] | None = None,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        sample_split: int = 1,
        mode: str | None = None,
        places: Any = None,
    ) -> _EngineLoader:
        """Global batches of ``dataset`` (the Engine splits each one as its plan needs)."""
        self._mode = _check_mode(mode, self._mode)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"Engine.dataloader: batch_size must be a positive int, got {batch_size!r}")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"Engine.dataloader: steps_per_epoch must be a positive int, got {steps_per_epoch!r}")
        if worker_init_fn is not None:
            raise ValueError(
                "Engine.dataloader: worker_init_fn is not supported (batches load in the training process)"
            )
        self._batch_hint = batch_size
        sampler = BatchSampler(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
        kwargs: dict[str, Any] = {"batch_sampler": sampler}
        if collate_fn is not None:
            kwargs["collate_fn"] = collate_fn
        return _EngineLoader(DataLoader(dataset, **kwargs), steps_per_epoch, int(epochs))

    # ------------------------------------------------------------------ the step
    def _split(self, data: Any) -> tuple[list[Tensor], list[Tensor]]:
        fields = [f if isinstance(f, Tensor) else Tensor(np.asarray(f)) for f in _as_list(data)]
        if not fields:
            raise ValueError("Engine.run: no data (a batch [inputs..., labels...] from engine.dataloader)")
        n_in = len(self._inputs_spec) or max(1, len(fields) - max(len(self._labels_spec), 1))
        if self._labels_spec and len(fields) != n_in + len(self._labels_spec):
            raise ValueError(
                f"Engine.run: a batch of {len(fields)} fields, but prepare() named {n_in} inputs and "
                f"{len(self._labels_spec)} labels"
            )
        return fields[:n_in], fields[n_in:]

    def _wrapped_loss(self, out: Tensor, *labels: Tensor) -> Tensor:
        assert self.loss is not None
        value = self.loss(out, *labels)
        if out.is_abstract:  # the probe: the layouts a micro-batch's output and loss have
            self._probe_out = (out._spec, tuple(out.shape), out.dtype, (value._spec, value.dtype))
        else:
            self._stash.append((out, value))
        return value

    def _decide_layout(self, inputs: Sequence[Tensor]) -> None:
        """Data parallel unless the model places itself (its forward traced once, shape only)."""
        if self._placed is not None:
            return
        assert self.model is not None
        abstract = [Tensor.abstract(t.shape, t.dtype) for t in inputs]
        rec = PlanRecorder({"kind": "engine_probe"})
        with rec, autograd.no_grad():
            self.model(*abstract)
        plan = rec.plan()
        self._placed = bool(plan.meshes) or any(p.is_dist for p in self.model.parameters())
        if not self._placed:
            backend = current_backend()
            world = backend.world_size
            sh = self.strategy.sharding
            fixed = backend.name in ("mpi", "nccl") or getattr(backend, "_fixed", None) is not None
            if sh.enable and sh.degree is not None and not fixed:
                world = int(sh.degree)  # no launcher: the simulator hosts as many ranks as asked for
            self._dp_mesh = ProcessMesh(list(range(world)), dim_names=["dp"])
            for p in self.model.parameters():
                if not p.is_dist:
                    shard_tensor(p, self._dp_mesh, [Replicate()])
            if sh.enable and sh.degree not in (None, world):
                raise ValueError(
                    f"Strategy.sharding.degree = {sh.degree}, but data parallelism spans the world of {world} ranks; "
                    f"set degree = {world} (or leave it None)"
                )
        elif self.strategy.sharding.enable and self.strategy.sharding.mesh_dim not in {
            n for m in plan.meshes for n in m.dim_names
        }:
            raise ValueError(
                f"Strategy.sharding: the model's meshes have axes {sorted({n for m in plan.meshes for n in m.dim_names})}, "
                f"none named {self.strategy.sharding.mesh_dim!r} to shard the optimizer over (sharding.mesh_dim)"
            )

    def _model_for_strategy(self) -> None:
        """Apply ``recompute``: each direct sub-layer's forward runs again in backward."""
        assert self.model is not None
        if not self.strategy.recompute.enable or getattr(self.model, "_engine_recompute", False):
            return
        children = list(self.model.children())
        if not children:
            raise ValueError("Strategy.recompute: the model has no sub-layers to recompute")
        for child in children:
            child.forward = functools.partial(recompute, child.forward)  # type: ignore[method-assign]
        self.model._engine_recompute = True  # type: ignore[attr-defined]

    def _ensure_model(self, inputs: Sequence[Tensor]) -> DistModel:
        if self._dist_model is not None:
            return self._dist_model
        if self.model is None:
            raise ValueError("Engine: no model (Engine(model, loss, optimizer, metrics, strategy=...))")
        self._decide_layout(inputs)
        self._model_for_strategy()
        strategy = self.strategy
        if strategy.gradient_merge.enable:
            strategy.gradient_merge.k_steps = int(strategy.gradient_merge.k_steps)
        loss = self._wrapped_loss if self.loss is not None else None
        self._dist_model = DistModel(self.model, None, loss, self.optimizer, strategy)
        return self._dist_model

    def _place(self, fields: Sequence[Tensor]) -> list[Tensor]:
        if self._dp_mesh is None:
            return list(fields)
        placed = []
        for f in fields:
            t = f.detach() if not f.is_dist else f
            t.stop_gradient = f.stop_gradient
            placed.append(shard_tensor(t, self._dp_mesh, [Shard(0)]) if not t.is_dist else t)
        return placed

    def _check_pipeline_batch(self, inputs: Sequence[Tensor]) -> None:
        pp = self.strategy.pipeline
        if not pp.enable or pp.micro_batch_size is None:
            return
        batch = int(inputs[0].shape[0])
        want = int(pp.micro_batch_size) * int(pp.accumulate_steps)
        if batch != want:
            raise ValueError(
                f"Engine.run: a batch of {batch}, but Strategy.pipeline.micro_batch_size ({pp.micro_batch_size}) * "
                f"accumulate_steps ({pp.accumulate_steps}) = {want}"
            )

    def run(
        self, data: Any = None, feed: Any = None, fetch_list: Any = None, mode: str | None = None
    ) -> dict[str, Any]:
        """One step on a global batch ``[inputs..., labels...]``: train (forward, backward,
        update), eval (loss and metrics) or predict (outputs); returns Paddle's dict."""
        if feed is not None or fetch_list is not None:
            raise ValueError("Engine.run: feed=/fetch_list= are not supported; pass the batch as data")
        mode = _check_mode(mode, self._mode)
        inputs, labels = self._split(data)
        dist_model = self._ensure_model(inputs)
        if mode == "predict":
            dist_model.predict()
            with autograd.no_grad():
                out = self.model(*self._place(inputs))  # type: ignore[misc]
            return {"outputs": [np.asarray(o.numpy()) for o in _as_list(out)]}
        if self.loss is None:
            raise ValueError(f"Engine.run(mode={mode!r}) needs a loss (Engine(model, loss, ...))")
        self._check_pipeline_batch(inputs)
        placed = self._place([*inputs, *labels])
        self._stash = []
        if mode == "train":
            if self.optimizer is None:
                raise ValueError("Engine.run(mode='train') needs an optimizer (Engine(model, loss, optimizer, ...))")
            dist_model.train()
            mean = dist_model(*placed)
        else:
            dist_model.eval()
            mean = dist_model(*placed)
        return self._outputs(mean, labels, dist_model)

    def _micro(self, dist_model: DistModel) -> list[tuple[Tensor, Tensor]]:
        """Each micro-batch's (output, loss); placeholders where this process held no rank of
        the last stage, so every process takes part in gathering them."""
        m = dist_model.microbatches if dist_model.mode == "train" else 1
        if len(self._stash) == m:
            return list(self._stash)
        if self._probe_out is None or self._stash:
            raise RuntimeError(f"Engine: {len(self._stash)} of {m} micro-batch outputs were seen on this process")
        out_spec, _shape, out_dtype, (loss_spec, loss_dtype) = self._probe_out
        return [
            (Tensor._from_shards(out_spec, {}, out_dtype), Tensor._from_shards(loss_spec, {}, loss_dtype))
            for _ in range(m)
        ]

    def _outputs(self, mean: Tensor, labels: Sequence[Tensor], dist_model: DistModel) -> dict[str, Any]:
        micro = self._micro(dist_model)
        pipeline = self._pipelined(dist_model)
        losses = [float(loss) for _, loss in micro] if pipeline else []
        self.last_loss = float(np.mean(losses)) if pipeline else float(mean)
        outs: dict[str, Any] = {"loss": losses if pipeline else self.last_loss}
        if self.metrics:
            pred = np.concatenate([np.asarray(o.numpy()) for o, _ in micro], axis=0) if micro else None
            label = np.asarray(labels[0].numpy()) if labels else None
            for metric in self.metrics:
                metric.update(*_as_list(metric.compute(Tensor(pred), Tensor(label))))
                for name, value in zip(metric.name(), _as_list(metric.accumulate()), strict=True):
                    outs[name] = value
        if pipeline and not self._holds_last_stage(micro):
            return {}
        return outs

    def _pipelined(self, dist_model: DistModel) -> bool:
        return dist_model.mode == "train" and dist_model.schedule is not None

    def _holds_last_stage(self, micro: Sequence[tuple[Tensor, Tensor]]) -> bool:
        backend = current_backend()
        loss = micro[-1][1] if micro else None
        if loss is None or not loss.is_dist:
            return True
        return any(backend.hosts(r) for r in loss.spec.mesh.process_ids)

    # ------------------------------------------------------------------ Paddle's loops
    def _loader(self, data: Any, batch_size: int, steps: int | None, collate_fn: Any) -> Any:
        if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            return self.dataloader(data, batch_size=batch_size, steps_per_epoch=steps, collate_fn=collate_fn)
        if isinstance(data, (_EngineLoader, DataLoader)):
            return data
        raise TypeError(f"Engine: data must be a paddle.io.Dataset or a loader, got {type(data).__name__}")

    def fit(
        self,
        train_data: Any,
        train_sample_split: int | None = None,
        batch_size: int = 1,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        log_freq: int = 10,
        save_dir: str | None = None,
        save_freq: int = 1,
        valid_data: Any = None,
        valid_sample_split: int | None = None,
        valid_freq: int = 1,
        valid_steps: int | None = None,
        collate_fn: Callable[..., Any] | None = None,
        callbacks: Any = None,
        verbose: int = 2,
        nvprof_range: Sequence[int] = (-1, -1),
    ) -> dict[str, list[float]]:
        """Train ``epochs`` epochs; logs every ``log_freq`` steps; returns the history."""
        if callbacks:
            raise ValueError("Engine.fit: callbacks are not supported")
        if save_dir is not None:
            raise ValueError("Engine.fit: save_dir is not supported; call engine.save(path) after fit")
        loader = self._loader(train_data, batch_size, steps_per_epoch, collate_fn)
        history: dict[str, list[float]] = {}
        for epoch in range(int(epochs)):
            for metric in self.metrics:
                metric.reset()
            for step, data in enumerate(loader()):
                outs = self.run(data, mode="train")
                history.setdefault("loss", []).append(self.last_loss)  # type: ignore[arg-type]
                if verbose and log_freq and step % log_freq == 0:
                    shown = " ".join(f"{k}: {self._show(v)}" for k, v in outs.items() if k != "loss")
                    print_once(
                        f"[train] epoch: {epoch} step: {step} loss: {self.last_loss:.6f} {shown}".rstrip(), flush=True
                    )
            for metric in self.metrics:
                for name, value in zip(metric.name(), _as_list(metric.accumulate()), strict=True):
                    history.setdefault(name, []).append(float(value))
            if valid_data is not None and (epoch + 1) % max(1, valid_freq) == 0:
                result = self.evaluate(
                    valid_data, batch_size=batch_size, steps=valid_steps, log_freq=log_freq, verbose=verbose
                )
                for k, v in result.items():
                    history.setdefault(f"eval_{k}", []).append(float(v))
        self._mode = "train"
        self.history = history
        return history

    @staticmethod
    def _show(v: Any) -> str:
        return f"{v:.6f}" if isinstance(v, float) else str(v)

    def evaluate(
        self,
        valid_data: Any,
        valid_sample_split: int | None = None,
        batch_size: int = 1,
        steps: int | None = None,
        log_freq: int = 10,
        collate_fn: Callable[..., Any] | None = None,
        callbacks: Any = None,
        verbose: int = 2,
    ) -> dict[str, float]:
        """The mean loss and the metrics over ``valid_data``."""
        if callbacks:
            raise ValueError("Engine.evaluate: callbacks are not supported")
        loader = self._loader(valid_data, batch_size, steps, collate_fn)
        for metric in self.metrics:
            metric.reset()
        losses: list[float] = []
        outs: dict[str, Any] = {}
        for data in loader():
            outs = self.run(data, mode="eval")
            losses.append(self.last_loss)  # type: ignore[arg-type]
        result = {"loss": float(np.mean(losses)) if losses else math.nan}
        result.update({k: float(v) for k, v in outs.items() if k != "loss"})
        if verbose:
            print_once("[eval] " + " ".join(f"{k}: {v:.6f}" for k, v in result.items()), flush=True)
        return result

    def predict(
        self,
        test_data: Any,
        test_sample_split: int | None = None,
        batch_size: int = 1,
        steps: int | None = None,
        collate_fn: Callable[..., Any] | None = None,
        callbacks: Any = None,
        verbose: int = 2,
    ) -> list[list[np.ndarray]]:
        """The model's outputs per batch (the batch's inputs only are read)."""
        if callbacks:
            raise ValueError("Engine.predict: callbacks are not supported")
        loader = self._loader(test_data, batch_size, steps, collate_fn)
        return [self.run(data, mode="predict")["outputs"] for data in loader()]

    # ------------------------------------------------------------------ state
    def save(self, path: str, training: bool = True) -> None:
        """Save the model's state (and, ``training``, the optimizer's) as a checkpoint directory
        (``dist.save_state_dict``: a collective, every process calls it)."""
        if self.model is None:
            raise ValueError("Engine.save: no model")
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if training and self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        save_state_dict(state, path)

    def load(self, path: str, strict: bool = True, load_optimizer: bool = True) -> None:
        """Load what ``save`` wrote: the model's state, and the optimizer's when it has states to
        fill (after its first step; before, load with ``load_optimizer=False``)."""
        if self.model is None:
            raise ValueError("Engine.load: no model")
        state: dict[str, Any] = {"model": self.model.state_dict()}
        opt = self.optimizer if load_optimizer else None
        if opt is not None:
            if not opt.state_tensors():
                raise ValueError(
                    "Engine.load: the optimizer has no states to fill before its first step; "
                    "load with load_optimizer=False, or after one step"
                )
            state["optimizer"] = opt.state_dict()
        load_state_dict(state, path)
        if opt is not None:
            opt.set_state_dict(state["optimizer"])

    # ------------------------------------------------------------------ programs
    def _plan(self) -> Plan:
        """The step's plan: traced from the prepared specs (a ``None`` batch dimension is the
        dataloader's batch size) when no step has run yet."""
        if self._dist_model is None or self._dist_model._plan is None:
            if not self._inputs_spec:
                raise ValueError("Engine: no program yet; call prepare(inputs_spec=..., labels_spec=...) or run a step")
            batch = self._batch_hint or 1
            fields = [Tensor.abstract(s.traced_shape(batch), s.dtype) for s in [*self._inputs_spec, *self._labels_spec]]
            inputs = fields[: len(self._inputs_spec)]
            dist_model = self._ensure_model(inputs)
            placed = self._place_abstract(fields)
            dist_model.train()
            dist_model._prepare(placed)
        assert self._dist_model is not None and self._dist_model._plan is not None
        return self._dist_model._plan

    def _place_abstract(self, fields: Sequence[Tensor]) -> list[Tensor]:
        if self._dp_mesh is None:
            return list(fields)
        return [shard_tensor(f, self._dp_mesh, [Shard(0)]) for f in fields]

    @property
    def main_program(self) -> PlanProgram:
        return StepPrograms(self._plan).main_program

    @property
    def serial_main_program(self) -> PlanProgram:
        return StepPrograms(self._plan).serial_main_program

    @property
    def startup_program(self) -> PlanProgram:
        return StepPrograms(self._plan).startup_program

    @property
    def serial_startup_program(self) -> PlanProgram:
        return StepPrograms(self._plan).serial_startup_program
