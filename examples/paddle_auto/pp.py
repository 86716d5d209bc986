"""Seed 000 §4.3: pipeline parallelism by hand -- w0 on mesh0, w1 on mesh1, reshard between.

python -m simulator -n 8 examples/paddle_auto/pp.py --tiny
mpiexec -n 8 python examples/paddle_auto/pp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import log_step, parser, require_world, seeded_uniform, setup

import mpipar as dist
from mpipar.io import BatchSampler, DataLoader

args = parser(__doc__.splitlines()[0]).parse_args()
setup(args)
SEQ, HIDDEN, INNER = (8, 32, 64) if args.tiny else (128, 1024, 4096)
require_world(8, "meshes [0..3] and [4..7]")
mesh0 = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
mesh1 = dist.ProcessMesh([4, 5, 6, 7], dim_names=["x"])


class RandomDataset(dist.io.Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        super().__init__()
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        return seeded_uniform(index, [self.seq_len, self.hidden], args.dtype)

    def __len__(self):
        return self.num_samples


class MlpModel(dist.nn.Layer):
    def __init__(self):
        super().__init__()
        self.w0 = dist.shard_tensor(self.create_parameter(shape=[HIDDEN, INNER]), mesh0, [dist.Replicate()])
        self.w1 = dist.shard_tensor(self.create_parameter(shape=[INNER, HIDDEN]), mesh1, [dist.Replicate()])

    def forward(self, x):
        y = dist.matmul(x, self.w0)
        # reshard: move stage 0's result to stage 1
        y = dist.reshard(y, mesh1, [dist.Replicate()])
        z = dist.matmul(y, self.w1)
        return z


model = MlpModel()
dataset = RandomDataset(SEQ, HIDDEN)
dataloader = DataLoader(dataset, batch_sampler=BatchSampler(dataset, batch_size=4))
opt = dist.optimizer.AdamW(learning_rate=0.001, parameters=model.parameters())

for step, inputs in enumerate(dataloader):
    if step >= args.steps:
        break
    x = dist.shard_tensor(inputs, mesh0, [dist.Replicate()])
    loss = dist.mean(model(x))
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
