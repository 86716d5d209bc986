"""Seed 003 §2.2.4.2.1: data parallelism in semi-automatic style -- mark the batch Shard(0).

python -m simulator -n 2 examples/paddle_auto/primer_dp.py --tiny
mpiexec -n 2 python examples/paddle_auto/primer_dp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import require_world
from primer_common import SimpleNet, class_dim, primer_args, setup, sizes, train

import mpipar as dist

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(2, "mesh [0, 1]")
world_process_mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])


class DPNet(SimpleNet):
    def forward(self, x):
        x = dist.shard_tensor(x, world_process_mesh, [dist.Shard(0)])
        return super().forward(x)


input_size, inner_size, _ = sizes(args)
train(args, DPNet(input_size, inner_size, class_dim))
