"""Seed 003 §2.2.4.2.3: pipeline parallelism -- linear1 on mesh[0], linear3 on mesh[1].

    python -m simulator -n 2 examples/primer_pp.py --tiny
    mpiexec -n 2 python examples/primer_pp.py --tiny
"""

from common import require_world
from primer_common import SimpleNet, class_dim, primer_args, setup, sizes, train

import mpipar as dist
from mpipar import shard_op

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(2, "mesh [0, 1]")
world_process_mesh = dist.ProcessMesh([0, 1], dim_names=["pp"])


class PPNet(SimpleNet):
    def forward(self, x):
        x = shard_op(self.linear1, world_process_mesh[0])(x)
        x = self.linear2(x)
        x = shard_op(self.linear3, world_process_mesh[1])(x)
        x = self.relu(x)
        return x


input_size, inner_size, _ = sizes(args)
train(args, PPNet(input_size, inner_size, class_dim))
