"""Seed 000 §4.1: data parallelism -- mark the input batch Shard(0); nothing else changes.

python -m simulator -n 4 examples/paddle_auto/dp.py --tiny
mpiexec -n 4 python examples/paddle_auto/dp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import log_step, parser, require_world, seeded_uniform, setup

import mpipar as dist
from mpipar.io import BatchSampler, DataLoader, Dataset

args = parser(__doc__.splitlines()[0]).parse_args()
setup(args)
SEQ, HIDDEN, INNER = (8, 32, 64) if args.tiny else (128, 1024, 4096)
require_world(4, "mesh [0, 1, 2, 3]")
mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])


class RandomDataset(Dataset):
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
        self.w0 = self.create_parameter(shape=[HIDDEN, INNER])
        self.w1 = self.create_parameter(shape=[INNER, HIDDEN])

    def forward(self, x):
        dist.shard_tensor(x, mesh, [dist.Shard(0)])  # mark the data as sharded (in place)
        y = dist.matmul(x, self.w0)
        z = dist.matmul(y, self.w1)
        return z


model = MlpModel()
dataset = RandomDataset(SEQ, HIDDEN)
sampler = BatchSampler(dataset, batch_size=4)
dataloader = DataLoader(dataset, batch_sampler=sampler)
opt = dist.optimizer.AdamW(learning_rate=0.001, parameters=model.parameters())
opt = dist.shard_optimizer(opt)

for step, inputs in enumerate(dataloader):
    if step >= args.steps:
        break
    data = inputs
    logits = model(data)
    loss = dist.mean(logits)
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
