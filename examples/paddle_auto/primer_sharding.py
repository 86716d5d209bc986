"""Seed 003 §2.2.3.2: group sharded (ZeRO) data parallelism, --stage 1|2|3.

python -m simulator -n 2 examples/paddle_auto/primer_sharding.py --tiny --stage 2
mpiexec -n 2 python examples/paddle_auto/primer_sharding.py --tiny --stage 3
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import require_world
from primer_common import SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes, train

import mpipar as dist

parser = primer_args(__doc__.splitlines()[0])
parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3], help="ZeRO stage")
args = parser.parse_args()
setup(args)
require_world(2, "mesh [0, 1]")
mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])

input_size, inner_size, _ = sizes(args)
model = dist.shard_layer(SimpleNet(input_size, inner_size, class_dim), mesh)
stage = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[args.stage]("dp", mesh)
optimizer = dist.shard_optimizer(optimizer_setting(model.parameters()), stage)
train(
    args,
    model,
    optimizer,
    place_batch=lambda img, label: (
        dist.shard_tensor(img, mesh, [dist.Shard(0)]),
        dist.shard_tensor(label, mesh, [dist.Shard(0)]),
    ),
)
