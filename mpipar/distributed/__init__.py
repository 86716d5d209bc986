"""``paddle.distributed`` spelled for mpipar: ``import mpipar.distributed as dist``.

    import mpipar as paddle
    import mpipar.distributed as dist             # import paddle.distributed as dist
    mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
    x = dist.shard_tensor(x, mesh, [dist.Shard(0)])
    from mpipar.distributed import fleet          # or paddle.distributed.fleet

Every name of ``paddle.distributed`` the seeds use: the auto-parallel API (``ProcessMesh``,
``shard_tensor``, ``reshard``, ``shard_layer``, ``shard_op``, ``to_static``, ``Strategy``, the
placements, ...; the same objects as ``mpipar.ProcessMesh`` and friends), the manual collectives
(``all_reduce``, ``new_group``, ...), ``fleet`` (Paddle's 4-D hybrid parallelism), ``sharding``
(``group_sharded_parallel``) and ``auto_parallel`` (the older module path). This module is a
front door only: the implementations live in the core and in ``mpipar.compat``.
"""

from mpipar.backend import get_rank, get_world_size
from mpipar.checkpoint import load_state_dict, save_state_dict
from mpipar.compat.collective import (
    Group,
    ReduceOp,
    all_gather,
    all_reduce,
    alltoall,
    barrier,
    broadcast,
    gather,
    irecv,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
)
from mpipar.compile.engine import Engine
from mpipar.compile.to_static import DistModel, Strategy, to_static
from mpipar.distribute import dtensor_from_local, reshard, shard_tensor
from mpipar.distributed import auto_parallel, fleet, launch, sharding
from mpipar.mesh import ProcessMesh
from mpipar.parallel import (
    ShardDataloader,
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_dataloader,
    shard_layer,
    shard_op,
    shard_optimizer,
)
from mpipar.placement import Partial, Placement, ReduceType, Replicate, Shard
from mpipar.tensor import DistTensor

__all__ = [
    "DistModel",
    "DistTensor",
    "Engine",
    "Group",
    "Partial",
    "Placement",
    "ProcessMesh",
    "ReduceOp",
    "ReduceType",
    "Replicate",
    "Shard",
    "ShardDataloader",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "Strategy",
    "all_gather",
    "all_reduce",
    "alltoall",
    "auto_parallel",
    "barrier",
    "broadcast",
    "dtensor_from_local",
    "fleet",
    "gather",
    "get_rank",
    "get_world_size",
    "irecv",
    "isend",
    "launch",
    "load_state_dict",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reshard",
    "save_state_dict",
    "scatter",
    "send",
    "shard_dataloader",
    "shard_layer",
    "shard_op",
    "shard_optimizer",
    "shard_tensor",
    "sharding",
    "to_static",
]
