"""Seed 000 §3, the principle: Replicate A times Shard(0) B on mesh [0, 1], then relu; prints D. Run: python -m simulator -n 2 examples/basics/principle.py (or mpiexec -n 2 python ...)."""
# Added around the seed's lines: Matmul and relu, the prose's names for the two ops, and the
# print of D (each hosted rank's shard, then the whole: the same on one device). The rest is the seed's.
import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import require_world

require_world(2, "mesh [0, 1]")
import mpipar as paddle
import mpipar.distributed as dist

Matmul = paddle.matmul
relu = paddle.nn.functional.relu

mesh = dist.ProcessMesh([0, 1], dim_names=['x'])
dense_tensorA = paddle.to_tensor([[1,2,], [3,4]])
dense_tensorB = paddle.to_tensor([[5,6], [7,8]])
placementsA = [dist.Replicate()]
placementsB = [dist.Shard(0)]

dist_tensorA = dist.shard_tensor(dense_tensorA, mesh, placementsA)
dist_tensorB = dist.shard_tensor(dense_tensorB, mesh, placementsB)
dist_tensorC = Matmul(dist_tensorA, dist_tensorB)
dist_tensorD = relu(dist_tensorC)

for rank in dist_tensorD.hosted_ranks:
    print(f"D: rank {rank}: {dist_tensorD.placements} {dist_tensorD.local_tensor(rank).tolist()}")
print("D:", dist_tensorD.full_tensor().tolist())
