"""``paddle.distributed.auto_parallel`` spelled ``mpipar.distributed.auto_parallel``: seed 003's
static-graph programs import ``ProcessMesh``, ``Engine`` and ``Strategy`` from it.

The ``Engine`` is ``mpipar.compile.engine``'s (built on ``dist.to_static``); the other names are
the same objects as ``mpipar.distributed``'s. ``shard_tensor(x, mesh, [None, "mp"])`` and
``shard_op(fn, mesh, [in_dims_mappings])`` take the older shard-spec spelling (per tensor dim a
mesh axis name or None) as well as placements.
"""

from mpipar.compile.engine import Engine
from mpipar.compile.to_static import Strategy
from mpipar.distribute import reshard, shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.parallel import shard_layer, shard_op
from mpipar.placement import Partial, Replicate, Shard

__all__ = [
    "Engine",
    "Partial",
    "ProcessMesh",
    "Replicate",
    "Shard",
    "Strategy",
    "reshard",
    "shard_layer",
    "shard_op",
    "shard_tensor",
]
