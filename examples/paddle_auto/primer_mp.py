"""Seed 003 §2.2.4.2.2: model (tensor) parallelism -- mark linear1 by columns, linear2 by rows.

python -m simulator -n 2 examples/paddle_auto/primer_mp.py --tiny
mpiexec -n 2 python examples/paddle_auto/primer_mp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import require_world
from primer_common import SimpleNet, class_dim, primer_args, setup, sizes, train

import mpipar as dist
from mpipar import Shard, shard_op, shard_tensor

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(2, "mesh [0, 1]")
world_process_mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])


class MPNet(SimpleNet):
    def forward(self, x):
        shard_tensor(self.linear1.weight, world_process_mesh, [Shard(1)])
        shard_tensor(self.linear1.bias, world_process_mesh, [Shard(0)])
        shard_tensor(self.linear2.weight, world_process_mesh, [Shard(0)])
        x = self.linear1(x)
        x = self.linear2(x)
        x_dims_mapping = [None, None]
        w_dims_mapping = [None, None]
        x = (
            shard_op(dist.matmul, world_process_mesh, [x_dims_mapping, w_dims_mapping])(x, self.linear3.weight)
            + self.linear3.bias
        )
        x = self.relu(x)
        return x


input_size, inner_size, _ = sizes(args)
train(args, MPNet(input_size, inner_size, class_dim))
