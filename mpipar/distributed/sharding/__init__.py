"""``paddle.distributed.sharding`` spelled ``mpipar.distributed.sharding``; the implementation is
``mpipar.compat.sharding`` (ZeRO-1/2/3 as levels ``os``, ``os_g``, ``p_g_os``)."""

from mpipar.compat.sharding import GroupShardedModel, GroupShardedOptimizer, group_sharded_parallel

__all__ = ["GroupShardedModel", "GroupShardedOptimizer", "group_sharded_parallel"]
