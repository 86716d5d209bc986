"""``paddle.distributed.fleet`` spelled ``mpipar.distributed.fleet``; the implementation is ``mpipar.compat.fleet``."""

from mpipar.compat.fleet import (
    CommunicateTopology,
    DistributedStrategy,
    HybridCommunicateGroup,
    HybridParallelModel,
    HybridParallelOptimizer,
    ParallelMode,
    barrier_worker,
    distributed_model,
    distributed_optimizer,
    get_hybrid_communicate_group,
    init,
    is_first_worker,
    meta_parallel,
    utils,
    worker_index,
    worker_num,
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
