"""mpipar: semi-automatic parallel training. Mark a few tensors; the rest is inferred.

    import mpipar as dist
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    t = dist.shard_tensor(np.arange(12.0).reshape(4, 3), mesh, [dist.Shard(0), dist.Shard(1)])
    t.local_tensor(1)                         # the (2, 1) shard of rank 1
    u = dist.reshard(t, mesh, [dist.Replicate(), dist.Shard(0)])

Run the same script with ``python script.py`` (simulator, every rank in-process),
``python -m simulator -n 8 script.py``, ``python -m simulator --reference script.py``
(one big device) or ``mpiexec -n 8 python script.py``.
"""

from mpipar import _threads  # noqa: F401, I001  (first: caps BLAS threads under MPI before NumPy loads)
from mpipar import io, metric, nn, ops, optimizer, pipeline, regularizer, spmd
from mpipar.compat import collective
from mpipar.compat import oneflow  # noqa: F401  (installs Tensor.placement, to_global, to_local)
from mpipar.autoshard import auto_shard
from mpipar.autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from mpipar.backend import current_backend, get_rank, get_world_size, set_backend, use_backend
from mpipar.checkpoint import load_state_dict, save_state_dict
from mpipar.compat.collective import (
    Group,
    ReduceOp,
    Task,
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
from mpipar.comm import CommEvent, comm_context
from mpipar.debug import CommDebugMode
from mpipar.distribute import dtensor_from_local, reshard, shard_tensor
from mpipar.debug.memory import MemoryReport, memory_report
from mpipar.optimizer.offload import offload_optimizer
from mpipar.overlap import GradReduceOverlap, overlap_grad_reduction
from mpipar.mesh import ProcessMesh
from mpipar.nn.layer import get_default_dtype, set_default_dtype
from mpipar.ops.linalg import matmul
from mpipar.ops.manipulation import broadcast_to, concat, expand, reshape, split, squeeze, transpose, unsqueeze
from mpipar.ops.manipulation import slice_ as slice
from mpipar.ops.math import (
    add,
    assign,
    cast,
    divide,
    equal,
    exp,
    greater_equal,
    greater_than,
    less_equal,
    less_than,
    log,
    maximum,
    mean,
    minimum,
    multiply,
    neg,
    not_equal,
    rsqrt,
    scale,
    sigmoid,
    sqrt,
    square,
    subtract,
    tanh,
    where,
)
from mpipar.ops.math import abs_ as abs
from mpipar.ops.math import max_ as max
from mpipar.ops.math import min_ as min
from mpipar.ops.math import pow_ as pow
from mpipar.ops.math import sum_ as sum
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
from mpipar.placement import Partial, Placement, ReduceType, Replicate, Shard, ZigzagShard, parse_placements
from mpipar.random import get_rng_state, seed, set_rng_state
from mpipar.recompute import recompute
from mpipar.compile.replay import CompiledStep, compile_step
from mpipar.reshard import ReshardPlan, ReshardStep, plan_reshard
from mpipar.debug import measured as _measured  # noqa: F401  (registers the MPIPAR_TRACE start with the backend)
from mpipar.runtime.heartbeat import mark_step
from mpipar.runtime.hosts import host_mesh, rank_hosts
from mpipar.runtime.log import print_once
from mpipar.spec import DistSpec, chunk_range
from mpipar.compile.to_static import DistModel, Strategy, to_static
from mpipar.compile.program import CPUPlace, CUDAPlace, disable_static, enable_static, in_dynamic_mode
from mpipar.tensor import DistTensor, Parameter, Shape, Tensor, to_tensor
from mpipar.version import __version__  # noqa: F401  (mpipar.__version__)


def __getattr__(name: str) -> object:
    """``mpipar.distributed``, ``mpipar.fleet``, ``mpipar.static`` and ``mpipar.base`` load on first use, so ``import mpipar as paddle``
    then ``paddle.distributed.fleet`` works as in Paddle without importing fleet for every script."""
    import importlib

    if name == "distributed":
        return importlib.import_module("mpipar.distributed")
    if name == "fleet":
        return importlib.import_module("mpipar.distributed.fleet")
    if name in ("static", "base", "metric", "regularizer"):
        return importlib.import_module(f"mpipar.{name}")
    raise AttributeError(f"module 'mpipar' has no attribute {name!r}")


# Paddle's names shadow a few builtins on purpose (dist.sum, dist.max, dist.slice, ...).
__all__ = [
    "CPUPlace",
    "CUDAPlace",
    "CommDebugMode",
    "CommEvent",
    "CompiledStep",
    "DistModel",
    "DistSpec",
    "DistTensor",
    "GradReduceOverlap",
    "Group",
    "MemoryReport",
    "Parameter",
    "Partial",
    "Placement",
    "ProcessMesh",
    "ReduceOp",
    "ReduceType",
    "Replicate",
    "ReshardPlan",
    "ReshardStep",
    "Shape",
    "Shard",
    "ShardDataloader",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "Strategy",
    "Task",
    "Tensor",
    "ZigzagShard",
    "abs",
    "add",
    "all_gather",
    "all_reduce",
    "alltoall",
    "assign",
    "auto_shard",
    "barrier",
    "broadcast",
    "broadcast_to",
    "cast",
    "chunk_range",
    "collective",
    "comm_context",
    "compile_step",
    "concat",
    "current_backend",
    "disable_static",
    "divide",
    "dtensor_from_local",
    "enable_grad",
    "enable_static",
    "equal",
    "exp",
    "expand",
    "gather",
    "get_default_dtype",
    "get_rank",
    "get_rng_state",
    "get_world_size",
    "greater_equal",
    "greater_than",
    "host_mesh",
    "in_dynamic_mode",
    "io",
    "irecv",
    "is_grad_enabled",
    "isend",
    "less_equal",
    "less_than",
    "load_state_dict",
    "log",
    "mark_step",
    "matmul",
    "max",
    "maximum",
    "mean",
    "memory_report",
    "metric",
    "min",
    "minimum",
    "multiply",
    "neg",
    "new_group",
    "nn",
    "no_grad",
    "not_equal",
    "offload_optimizer",
    "ops",
    "optimizer",
    "overlap_grad_reduction",
    "parse_placements",
    "pipeline",
    "plan_reshard",
    "pow",
    "print_once",
    "rank_hosts",
    "recompute",
    "recv",
    "reduce",
    "reduce_scatter",
    "regularizer",
    "reshape",
    "reshard",
    "rsqrt",
    "save_state_dict",
    "scale",
    "scatter",
    "seed",
    "send",
    "set_backend",
    "set_default_dtype",
    "set_grad_enabled",
    "set_rng_state",
    "shard_dataloader",
    "shard_layer",
    "shard_op",
    "shard_optimizer",
    "shard_tensor",
    "sigmoid",
    "slice",
    "split",
    "spmd",
    "sqrt",
    "square",
    "squeeze",
    "subtract",
    "sum",
    "tanh",
    "to_static",
    "to_tensor",
    "transpose",
    "unsqueeze",
    "use_backend",
    "where",
]
