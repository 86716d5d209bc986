"""``PipelineParallel.train_batch``: one training step of a ``PipelineLayer`` over its stages.

The batch is cut into ``pipeline_configs['accumulate_steps']`` micro-batches of
``micro_batch_size`` rows. Each rank runs its stage's action list from ``mpipar.pipeline``'s
schedule builder (the same ``1F1B`` / ``FThenB`` tokens the simulator and the dashboard show):
``F`` runs the stage, ``SEND_F``/``RECV_F`` move activations to the next stage's rank (the
rank with the same data, sharding and model coordinates), ``B`` backpropagates, and
``SEND_B``/``RECV_B`` move the input gradients back. The last stage's loss of each
micro-batch is scaled by 1/accumulate_steps before its backward, so the accumulated
gradients are those of the whole batch's mean loss; after the schedule the optimizer steps
once and the mean loss is broadcast to every stage, as Paddle returns it.

A message carries a fixed-size header (dims and dtype) before the data, so a receiving stage
needs no knowledge of the shapes the previous stage produces.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpipar import autograd
from mpipar.compat.collective import broadcast, recv, send
from mpipar.compat.fleet.meta_parallel.pp_layers import PipelineLayer
from mpipar.compat.fleet.strategy import Resolved
from mpipar.compat.fleet.topology import HybridCommunicateGroup
from mpipar.nn.layer import Layer
from mpipar.ops.math import as_tensor, scale
from mpipar.pipeline import build_schedule
from mpipar.tensor import Tensor

_DTYPES = ("float16", "float32", "float64", "int32", "int64", "bool")
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS


def _header(value: np.ndarray) -> np.ndarray:
    if value.dtype.name not in _DTYPES or value.ndim > _MAX_DIMS:
        raise ValueError(
            f"pipeline: a stage's output {value.dtype}{list(value.shape)} cannot travel between stages; "
            f"outputs must be one tensor of at most {_MAX_DIMS} dims in {', '.join(_DTYPES)}"
        )
    h = np.zeros(_HEADER, dtype=np.int64)
    h[0], h[1] = value.ndim, _DTYPES.index(value.dtype.name)
    h[2 : 2 + value.ndim] = value.shape
    return h


def _send(value: Tensor, dst: int) -> None:
    data = np.ascontiguousarray(value.numpy())
    send(Tensor(_header(data)), dst)
    send(Tensor(data), dst)


def _recv(src: int) -> np.ndarray:
    h = Tensor(np.zeros(_HEADER, dtype=np.int64))
    recv(h, src)
    head = h.numpy()
    ndim, code = int(head[0]), int(head[1])
    if not (0 <= ndim <= _MAX_DIMS and 0 <= code < len(_DTYPES)):
        raise ValueError(f"pipeline: a message header from rank {src} is malformed: {head.tolist()}")
    buf = Tensor(np.zeros(tuple(int(d) for d in head[2 : 2 + ndim]), dtype=_DTYPES[code]))
    recv(buf, src)
    return buf.numpy()


class PipelineParallel(Layer):
    """A ``PipelineLayer`` with Paddle's ``train_batch`` / ``eval_batch``."""

    def __init__(self, layers: PipelineLayer, hcg: HybridCommunicateGroup, strategy: Resolved) -> None:
        super().__init__()
        if not isinstance(layers, PipelineLayer):
            raise TypeError(f"PipelineParallel needs a PipelineLayer, got {type(layers).__name__}")
        self._layers = layers
        self._hcg = hcg
        self.num_stages = hcg.get_pipe_parallel_world_size()
        self.stage_id = hcg.get_stage_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.num_stages - 1
        self.micro_batch_size = strategy.micro_batch_size
        self.accumulate_steps = strategy.accumulate_steps
        self.schedule = strategy.schedule
        self.prev_rank = hcg.get_rank_from_stage(self.stage_id - 1) if not self.is_first_stage else None
        self.next_rank = hcg.get_rank_from_stage(self.stage_id + 1) if not self.is_last_stage else None
        self.last_stage_rank = hcg.get_rank_from_stage(self.num_stages - 1)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._layers(*args, **kwargs)

    # ------------------------------------------------------------------ the batch
    def _micro_batches(self, data: Any) -> tuple[list[Any], list[Any]]:
        if not isinstance(data, list | tuple) or len(data) != 2:
            raise ValueError("train_batch: data must be [inputs, labels]")
        inputs, labels = (np.asarray(as_tensor(d).numpy()) for d in data)
        want = self.micro_batch_size * self.accumulate_steps
        for name, value in (("inputs", inputs), ("labels", labels)):
            if value.ndim == 0 or value.shape[0] != want:
                raise ValueError(
                    f"train_batch: {name} have {value.shape[0] if value.ndim else 0} rows but pipeline_configs "
                    f"micro_batch_size ({self.micro_batch_size}) * accumulate_steps ({self.accumulate_steps}) = {want}"
                )
        mb = self.micro_batch_size
        cut = [slice(i * mb, (i + 1) * mb) for i in range(self.accumulate_steps)]
        return [inputs[s] for s in cut], [labels[s] for s in cut]

    def _loss(self, output: Any, label: np.ndarray) -> Tensor:
        loss_fn = self._layers._loss_fn
        if loss_fn is None:
            raise ValueError("train_batch: the PipelineLayer has no loss_fn; pass PipelineLayer(..., loss_fn=...)")
        loss = loss_fn(output, Tensor(label))
        if not isinstance(loss, Tensor) or int(np.prod(loss.shape)) != 1:
            raise ValueError(
                f"train_batch: loss_fn must return a one-element tensor, got {getattr(loss, 'shape', loss)!r}"
            )
        return loss

    def _run_schedule(self, data: Any, train: bool) -> float:
        inputs, labels = self._micro_batches(data)
        n = self.accumulate_steps
        actions = build_schedule(self.schedule, self.num_stages, n).actions[self.stage_id]
        stage_in: dict[int, Tensor] = {}
        stage_out: dict[int, Tensor] = {}
        out_grad: dict[int, Tensor] = {}
        losses: list[float] = []
        for action in actions:
            kind, m = action.kind, action.microbatch
            if not train and kind in ("B", "SEND_B", "RECV_B"):
                continue
            if kind == "RECV_F":
                assert self.prev_rank is not None
                x = Tensor(_recv(self.prev_rank))
                x.stop_gradient = not train
                stage_in[m] = x
            elif kind == "F":
                x = stage_in[m] if not self.is_first_stage else Tensor(inputs[m])
                with autograd.set_grad_enabled(train):
                    out = self._layers(x)
                    if self.is_last_stage:
                        loss = self._loss(out, labels[m])
                        losses.append(float(loss.numpy().reshape(-1)[0]))
                        out = scale(loss, 1.0 / n)  # the batch's mean loss: gradients sum over micro-batches
                stage_out[m] = out
            elif kind == "SEND_F":
                assert self.next_rank is not None
                _send(stage_out[m], self.next_rank)
            elif kind == "RECV_B":
                assert self.next_rank is not None
                out_grad[m] = Tensor(_recv(self.next_rank))
            elif kind == "B":
                out = stage_out.pop(m)
                out.backward(None if self.is_last_stage else out_grad.pop(m))
            elif kind == "SEND_B":
                assert self.prev_rank is not None
                x = stage_in.pop(m)
                grad = x.grad if x.grad is not None else Tensor(np.zeros(tuple(x.shape), dtype=x.dtype))
                _send(grad, self.prev_rank)
            else:
                raise ValueError(
                    f"train_batch: schedule {self.schedule} gave action {action}, which fleet does not run"
                )
        return self._broadcast_loss(float(np.mean(losses)) if losses else 0.0)

    def _broadcast_loss(self, value: float) -> float:
        """The last stage's mean loss, on every stage (Paddle's train_batch returns it everywhere)."""
        if self.num_stages == 1:
            return value
        t = Tensor(np.array([value], dtype=np.float64))
        broadcast(t, src=self.last_stage_rank, group=self._hcg.get_pipe_parallel_group())
        return float(t.numpy()[0])

    def train_batch(self, data: Any, optimizer: Any, lr_scheduler: Any = None, scaler: Any = None) -> Tensor:
        """Forward and backward of every micro-batch on the schedule, then one optimizer step; the mean loss."""
        if scaler is not None:
            raise ValueError(
                "train_batch: loss scaling (scaler=) is for float16 training, which fleet does not run; pass None"
            )
        self._layers.train()
        loss = self._run_schedule(data, train=True)
        self._layers.allreduce_shared_weight_gradients()
        optimizer.step()
        optimizer.clear_grad()
        if lr_scheduler is not None:
            lr_scheduler.step()
        return Tensor(np.array(loss))

    def eval_batch(self, data: Any, compute_loss: bool = True) -> Tensor:
        """The mean loss of the batch without gradients (the forward half of the schedule)."""
        self._layers.eval()
        return Tensor(np.array(self._run_schedule(data, train=False)))


__all__ = ["PipelineParallel"]
