"""``paddle.distributed`` spelled for mpipar: the manual collectives and ``fleet``.

    import mpipar as paddle
    from mpipar.distributed import fleet          # or paddle.distributed.fleet
    fleet.init(is_collective=True, strategy=strategy)

The collectives are the same objects as ``mpipar.all_reduce`` and friends (manual mode);
``fleet`` is Paddle's 4-D hybrid parallelism (data, pipe, sharding, model) built on them.
"""

from mpipar.backend import get_rank, get_world_size
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
from mpipar.distributed import auto_parallel, fleet, launch

__all__ = [
    "Engine",
    "Group",
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "alltoall",
    "auto_parallel",
    "barrier",
    "broadcast",
    "fleet",
    "gather",
    "get_rank",
    "get_world_size",
    "irecv",
    "isend",
    "launch",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
