"""Paddle's ``fleet``: 4-D hybrid parallel training (data, pipe, sharding, model) in manual mode.

    from mpipar.distributed import fleet          # import paddle.distributed.fleet as fleet
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2, "sharding_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    model = fleet.distributed_model(PipelineLayer([...], loss_fn=...))
    opt = fleet.distributed_optimizer(dist.optimizer.AdamW(parameters=model.parameters()))
    loss = model.train_batch([x, y], opt)

Each rank runs its own program on its own tensors, as in Paddle: the layers of
``meta_parallel`` and the optimizer write their collectives with mpipar's manual API, so a
fleet script runs under ``mpiexec -n N``, ``python -m simulator -n N`` (one thread per rank)
and plainly as one device (every degree 1). Seed 001's spelling (degrees inside
``sharding_configs``) is accepted too; see ``strategy.py``.
"""

from __future__ import annotations

from typing import Any

from mpipar.compat.collective import broadcast
from mpipar.compat.fleet import meta_parallel, utils
from mpipar.compat.fleet.base import (
    barrier_worker,
    complete,
    get_hybrid_communicate_group,
    init,
    is_first_worker,
    resolved_strategy,
    strategy_was_given,
    worker_index,
    worker_num,
)
from mpipar.compat.fleet.optimizer import HybridParallelOptimizer
from mpipar.compat.fleet.strategy import DistributedStrategy
from mpipar.compat.fleet.topology import CommunicateTopology, HybridCommunicateGroup, ParallelMode
from mpipar.nn.layer import Layer
from mpipar.tensor import Tensor


class HybridParallelModel(Layer):
    """What ``distributed_model`` returns for a model that is not a ``PipelineLayer``. Its replicas
    start equal without a broadcast (mpipar's initialisers give every rank the same values), and
    its gradients are reduced by ``distributed_optimizer``'s step.

    With model parallelism (``mp_degree > 1``) every call first broadcasts its tensor inputs from
    the model group's first rank to the group, in place, as Paddle's ``TensorParallel`` does: the
    members of a model group compute one model on one batch, so they must see the same inputs
    even when each read its own (a ``DistributedBatchSampler`` over the world gives each a
    different share)."""

    def __init__(self, layers: Layer, hcg: HybridCommunicateGroup | None = None) -> None:
        super().__init__()
        self._layers = layers
        self._hcg = hcg

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hcg = self._hcg
        if hcg is not None and hcg.get_model_parallel_world_size() > 1:
            src, group = hcg.get_model_parallel_group_src_rank(), hcg.get_model_parallel_group()
            for t in [*args, *kwargs.values()]:
                if isinstance(t, Tensor) and not t.is_dist:
                    broadcast(t, src=src, group=group)
        return self._layers(*args, **kwargs)


def distributed_model(model: Layer) -> Layer:
    """A ``PipelineLayer`` becomes a ``PipelineParallel`` (``train_batch``); any other layer runs as is
    (``pp_degree`` must then be 1)."""
    resolved = resolved_strategy("fleet.distributed_model")
    hcg = get_hybrid_communicate_group()
    if isinstance(model, meta_parallel.PipelineLayer):
        return meta_parallel.PipelineParallel(model, hcg, resolved)
    if not isinstance(model, Layer):
        raise TypeError(f"fleet.distributed_model: expected a dist.nn.Layer, got {type(model).__name__}")
    if resolved.pp_degree > 1:
        raise ValueError(
            f"fleet.distributed_model: pp_degree = {resolved.pp_degree} needs the model written as a "
            "fleet.meta_parallel.PipelineLayer (a list of LayerDesc cut into stages)"
        )
    return HybridParallelModel(model, hcg)


def distributed_optimizer(optimizer: Any, strategy: DistributedStrategy | None = None) -> HybridParallelOptimizer:
    """``optimizer`` stepping with the hybrid groups' reductions, sharding, clipping, merge and offload.

    ``strategy`` may be given here (Paddle's static spelling): after ``fleet.init(is_collective=True)``
    without one, its degrees take effect (the groups are built from it); after ``fleet.init`` with
    a strategy it must be that one, since the groups cannot change under a built model."""
    if (
        strategy is not None
        and not strategy_was_given()
        and complete(strategy.resolved()) != resolved_strategy("fleet.distributed_optimizer")
    ):
        # Paddle's static spelling (seed 001): fleet.init(is_collective=True), then the strategy
        # here. Its degrees take effect: the groups are built from it now.
        init(is_collective=True, strategy=strategy)
    elif strategy is not None and complete(strategy.resolved()) != resolved_strategy("fleet.distributed_optimizer"):
        raise ValueError(
            "fleet.distributed_optimizer: the strategy differs from the one fleet.init built the groups "
            "from; pass it to fleet.init(is_collective=True, strategy=...) before building the model"
        )
    return HybridParallelOptimizer(
        optimizer, get_hybrid_communicate_group(), resolved_strategy("fleet.distributed_optimizer")
    )


__all__ = [
    "CommunicateTopology",
    "DistributedStrategy",
    "HybridCommunicateGroup",
    "HybridParallelModel",
    "HybridParallelOptimizer",
    "ParallelMode",
    "barrier_worker",
    "distributed_model",
    "distributed_optimizer",
    "get_hybrid_communicate_group",
    "init",
    "is_first_worker",
    "meta_parallel",
    "utils",
    "worker_index",
    "worker_num",
]
