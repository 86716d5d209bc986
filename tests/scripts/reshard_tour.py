"""A tour of reshards used by the launch-mode tests: prints values and communication counts."""

import numpy as np

import mpipar as dist

mesh0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
mesh1 = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])
value = np.arange(7 * 5, dtype=np.float64).reshape(7, 5)
with dist.CommDebugMode() as comm:
    a = dist.shard_tensor(value, mesh0, [dist.Shard(0), dist.Partial()])
    b = dist.reshard(a, mesh0, [dist.Shard(1), dist.Shard(0)])
    c = dist.reshard(b, mesh1, [dist.Shard(0)])
    d = dist.reshard(c, mesh0, [dist.Replicate(), dist.Replicate()])
    full = d.full_tensor()
print("backend", dist.current_backend().name, "world", dist.get_world_size(), "rank", dist.get_rank())
print("placements", dist.parse_placements("S(0)P") == a.placements, b.placements, c.placements)
print("equal", bool(np.array_equal(full, value)))
print("counts", dict(sorted(comm.counts().items())))
