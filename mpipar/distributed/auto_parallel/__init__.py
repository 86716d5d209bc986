"""``paddle.distributed.auto_parallel`` spelled ``mpipar.distributed.auto_parallel`` (the older path
of the auto-parallel API, seed 003's static programs import from it).

``ProcessMesh`` and ``Strategy`` are the same objects as ``mpipar.distributed``'s;
``shard_tensor(x, mesh, [None, "mp"])`` and ``shard_op(fn, mesh, [in_dims_mappings])`` take the
older shard-spec spelling (per tensor dim a mesh axis name or None) as well as placements.
The static-graph ``Engine`` joins these names from the static-graph module (``mpipar.static``)
when that exists; this module only re-exports.
"""

from mpipar.compile.to_static import Strategy
from mpipar.distribute import reshard, shard_tensor
from mpipar.mesh import ProcessMesh
from mpipar.parallel import shard_layer, shard_op
from mpipar.placement import Partial, Replicate, Shard

__all__ = [
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
