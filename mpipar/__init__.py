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

from mpipar import _threads  # noqa: F401  (first: caps BLAS threads under MPI before NumPy loads)
from mpipar import pipeline as pipeline  # mpipar.pipeline.build_schedule works after `import mpipar`
from mpipar.backend import current_backend, get_rank, get_world_size, set_backend, use_backend
from mpipar.checkpoint import load_state_dict, save_state_dict
from mpipar.comm import CommEvent, comm_context
from mpipar.debug import CommDebugMode
from mpipar.mesh import ProcessMesh
from mpipar.placement import Partial, Placement, ReduceType, Replicate, Shard, parse_placements
from mpipar.reshard import ReshardPlan, ReshardStep, plan_reshard
from mpipar.runtime.log import print_once
from mpipar.spec import DistSpec, chunk_range
from mpipar.tensor import DistTensor, Parameter, Shape, Tensor, dtensor_from_local, reshard, shard_tensor, to_tensor

__version__ = "0.1.0"

__all__ = [
    "CommDebugMode",
    "CommEvent",
    "DistSpec",
    "DistTensor",
    "Parameter",
    "Partial",
    "Placement",
    "ProcessMesh",
    "ReduceType",
    "Replicate",
    "ReshardPlan",
    "ReshardStep",
    "Shape",
    "Shard",
    "Tensor",
    "chunk_range",
    "comm_context",
    "current_backend",
    "dtensor_from_local",
    "get_rank",
    "get_world_size",
    "load_state_dict",
    "parse_placements",
    "plan_reshard",
    "print_once",
    "reshard",
    "save_state_dict",
    "set_backend",
    "shard_tensor",
    "to_tensor",
    "use_backend",
]
