"""Seed 003 §2.2.4.2.3: pipeline parallelism -- linear1 on mesh[0], linear3 on mesh[1].

python -m simulator -n 2 examples/paddle_auto/primer_pp.py --tiny
mpiexec -n 2 python examples/paddle_auto/primer_pp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import add_pipeline_args, log_step, pipeline_strategy, require_world
from primer_common import RandomDataset, SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes, train

import mpipar as dist
from mpipar import shard_op

p = primer_args(__doc__.splitlines()[0])
add_pipeline_args(p)
args = p.parse_args()
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


input_size, inner_size, batch_size = sizes(args)
model = PPNet(input_size, inner_size, class_dim)
if args.schedule is None:
    train(args, model)
else:  # the static-mode pipeline of §2.2.4.2.7, with a schedule and micro-batches
    loss_func = dist.nn.CrossEntropyLoss()
    dataset = RandomDataset(args.steps * batch_size, input_size, args.dtype)
    loader = dist.io.DataLoader(
        dataset, batch_sampler=dist.io.BatchSampler(dataset, batch_size=batch_size, drop_last=True)
    )
    dist_model = dist.to_static(
        model, loader, loss_func, optimizer_setting(model.parameters()), pipeline_strategy(args, 2)
    )
    dist_model.train()
    for batch_id, (img, label) in enumerate(loader()):
        loss = dist_model(img, label)
        log_step(batch_id, float(loss))
