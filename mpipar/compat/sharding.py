"""Paddle's ``paddle.distributed.sharding.group_sharded_parallel``: ZeRO in manual (per-rank) mode.

    model, optimizer, scaler = group_sharded_parallel(model, optimizer, level="p_g_os", group=group)

The members of ``group`` read different data (a ``DistributedBatchSampler``) and share one model.
Each parameter has one owner in the group (Paddle's partition: in order, to the member holding
the fewest elements so far); the owner alone keeps its optimizer states and updates it.

* ``level="os"`` (ZeRO-1): gradients are all-reduced (averaged) over the group in buckets, each
  owner updates its parameters, then broadcasts them to the group;
* ``level="os_g"`` (ZeRO-2): each gradient is reduced to its owner only (the others drop theirs),
  each owner updates, then broadcasts;
* ``level="p_g_os"`` (ZeRO-3): as ``os_g``, and between steps a member holds only the parameters
  it owns; the model gathers the others from their owners (a broadcast each) before its forward.

Each level computes what data parallelism over the group computes (the averaged gradient, the
same update), as the equivalence principle asks; only where state lives and what travels differ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpipar import autograd
from mpipar.backend import current_backend
from mpipar.compat.collective import Group, ReduceOp, all_reduce, broadcast, new_group, reduce
from mpipar.compat.fleet.optimizer import partition_parameters
from mpipar.nn.layer import Layer
from mpipar.optimizer.optimizer import Optimizer
from mpipar.tensor import Tensor

LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}
BUCKET_BYTES = 25 << 20
"""Stage 1 all-reduces consecutive gradients in buckets of about this size (Paddle's default
``buffer_max_size`` order of magnitude), one call per bucket."""


class GroupShardedOptimizer:
    """The wrapped optimizer, stepping with the group's reductions and broadcasts (see the module doc)."""

    def __init__(self, optimizer: Optimizer, group: Group, stage: int, model: GroupShardedModel | None = None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"group_sharded_parallel: optimizer must be an mpipar optimizer (paddle.optimizer.Momentum, ...), "
                f"got {type(optimizer).__name__}"
            )
        self._inner_opt = optimizer
        self._group, self._stage, self._model = group, stage, model
        self._params = list(optimizer._parameter_list)
        positions = partition_parameters(self._params, group.nranks)
        self._owner = {id(p): group.ranks[pos] for p, pos in zip(self._params, positions, strict=True)}
        me = int(current_backend().rank)
        self._owned = [p for p in self._params if self._owner[id(p)] == me]
        optimizer._parameter_list = list(self._owned)  # states exist for the owned parameters only

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner_opt, name)

    def owner_of(self, p: Tensor) -> int:
        return self._owner[id(p)]

    def clear_grad(self, set_to_zero: bool = True) -> None:
        for p in self._params:
            p.clear_grad()

    clear_gradients = clear_grad

    def state_dict(self) -> dict[str, Any]:
        return self._inner_opt.state_dict()

    def set_state_dict(self, state: dict[str, Any]) -> None:
        self._inner_opt.set_state_dict(state)

    def minimize(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()
        self.step()

    def step(self) -> None:
        with autograd.no_grad():
            if self._stage == 1:
                self._all_reduce_gradients()
            else:
                self._reduce_gradients_to_owners()
        self._inner_opt.step()
        if self._stage < 3:
            for p in self._params:
                broadcast(p, src=self._owner[id(p)], group=self._group)
        elif self._model is not None:
            self._model.release()

    def _all_reduce_gradients(self) -> None:
        pending = [(p, np.array(p.grad.numpy(), copy=True)) for p in self._params if p.grad is not None]
        buckets: list[list[tuple[Tensor, np.ndarray]]] = []
        size = 0
        for p, g in pending:
            if not buckets or size >= BUCKET_BYTES or buckets[-1][0][1].dtype != g.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append((p, g))
            size += g.nbytes
        for bucket in buckets:
            flat = Tensor(np.concatenate([g.reshape(-1) for _, g in bucket]))
            all_reduce(flat, op=ReduceOp.AVG, group=self._group)
            values, start = flat.numpy(), 0
            for p, g in bucket:
                p.grad = Tensor(values[start : start + g.size].reshape(g.shape))
                start += g.size

    def _reduce_gradients_to_owners(self) -> None:
        me = int(current_backend().rank)
        n = self._group.nranks
        for p in self._params:
            if p.grad is None:
                continue
            owner = self._owner[id(p)]
            t = Tensor(np.array(p.grad.numpy(), copy=True))
            reduce(t, dst=owner, op=ReduceOp.SUM, group=self._group)
            p.grad = Tensor(t.numpy() / n) if owner == me else None


class GroupShardedModel(Layer):
    """The model ``group_sharded_parallel`` returns. At ``p_g_os`` a member keeps only the parameters
    it owns between steps; each forward first gathers the others from their owners."""

    def __init__(self, layers: Layer, group: Group, stage: int) -> None:
        super().__init__()
        self._layers = layers
        self._group, self._stage = group, stage
        self._owner: dict[int, int] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._stage == 3:
            self.gather()
        return self._layers(*args, **kwargs)

    def _released(self, p: Tensor) -> bool:
        return p._dense is None and p._init is None and not p.is_dist

    def gather(self) -> None:
        """Every parameter whole on every member: each owner broadcasts its own (in order)."""
        with autograd.no_grad():
            for p in self._layers.parameters():
                owner = self._owner[id(p)]
                buf = Tensor(np.zeros(tuple(p.shape), dtype=p.dtype)) if self._released(p) else Tensor(p.numpy())
                broadcast(buf, src=owner, group=self._group)
                if self._released(p):
                    p._dense = buf._dense

    def release(self) -> None:
        """Drop the values of the parameters this member does not own (ZeRO-3's saving)."""
        me = int(current_backend().rank)
        for p in self._layers.parameters():
            if self._owner[id(p)] != me:
                p._dense = None


def group_sharded_parallel(
    model: Layer,
    optimizer: Optimizer,
    level: str,
    scaler: Any = None,
    group: Group | None = None,
    offload: bool = False,
    sync_buffers: bool = False,
    buffer_max_size: int = 2**23,
    segment_size: int = 2**20,
    sync_comm: bool = False,
    dp_group: Group | None = None,
    exclude_layer: Any = None,
) -> tuple[GroupShardedModel, GroupShardedOptimizer, Any]:
    """Paddle's ``group_sharded_parallel``: ``(model, optimizer, scaler)`` sharded over ``group``
    (the world when None) at ``level`` ``os`` / ``os_g`` / ``p_g_os`` (ZeRO-1/2/3)."""
    if level not in LEVELS:
        raise ValueError(f"group_sharded_parallel: level must be one of {sorted(LEVELS)} (ZeRO-1/2/3), got {level!r}")
    if not isinstance(model, Layer):
        raise TypeError(f"group_sharded_parallel: model must be a paddle.nn.Layer, got {type(model).__name__}")
    for name, value in (("offload", offload), ("dp_group", dp_group), ("exclude_layer", exclude_layer)):
        if value:
            raise ValueError(f"group_sharded_parallel: {name}= is not supported by mpipar; leave it unset")
    group = group if group is not None else new_group()
    stage = LEVELS[level]
    wrapped = GroupShardedModel(model, group, stage)
    opt = GroupShardedOptimizer(optimizer, group, stage, wrapped if stage == 3 else None)
    wrapped._owner = dict(opt._owner)
    missing = [p for p in model.parameters() if id(p) not in opt._owner]
    if missing:
        raise ValueError(
            f"group_sharded_parallel: {len(missing)} parameter(s) of the model are not in the optimizer's parameters "
            "(build the optimizer with parameters=model.parameters())"
        )
    if stage == 3:
        wrapped.release()
    return wrapped, opt, scaler


__all__ = ["GroupShardedModel", "GroupShardedOptimizer", "group_sharded_parallel"]
