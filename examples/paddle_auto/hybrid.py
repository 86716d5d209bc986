"""Seed 000 §4.4: 3-D hybrid -- dp on mesh axis x, tp on y, pipeline across mesh0 and mesh1.

python -m simulator -n 8 examples/paddle_auto/hybrid.py --tiny
mpiexec -n 8 python examples/paddle_auto/hybrid.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import add_pipeline_args, log_step, parser, pipeline_strategy, require_world, seeded_uniform, setup

import mpipar as dist
from mpipar.io import BatchSampler, DataLoader, Dataset

p = parser(__doc__.splitlines()[0])
add_pipeline_args(p)
args = p.parse_args()
setup(args)
SEQ, HIDDEN, INNER = (8, 32, 64) if args.tiny else (128, 1024, 4096)
require_world(8, "meshes [[0, 1], [2, 3]] and [[4, 5], [6, 7]]")
mesh0 = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])  # the process mesh of stage 0
mesh1 = dist.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])  # and of stage 1


class RandomDataset(Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        super().__init__()
        self.seq_len, self.hidden, self.num_samples = seq_len, hidden, num_samples

    def __getitem__(self, index):
        input = seeded_uniform(index, [self.seq_len, self.hidden], args.dtype, salt=0)
        label = seeded_uniform(index, [self.seq_len, self.hidden], args.dtype, salt=1)
        return input, label

    def __len__(self):
        return self.num_samples


class MlpModel(dist.nn.Layer):
    def __init__(self):
        super().__init__()
        self.w0 = dist.shard_tensor(
            self.create_parameter(shape=[HIDDEN, INNER]), mesh0, [dist.Replicate(), dist.Shard(1)]
        )  # tensor parallel, column split
        self.w1 = dist.shard_tensor(
            self.create_parameter(shape=[INNER, HIDDEN]), mesh1, [dist.Replicate(), dist.Shard(0)]
        )  # tensor parallel, row split

    def forward(self, x):
        y = dist.matmul(x, self.w0)
        y = dist.reshard(y, mesh1, [dist.Shard(0), dist.Shard(2)])  # pipeline parallel
        z = dist.matmul(y, self.w1)
        return z


model = MlpModel()
dataset = RandomDataset(SEQ, HIDDEN)
# With a schedule each of the 2 data-parallel shards needs a row per micro-batch.
sampler = BatchSampler(dataset, batch_size=2 if args.schedule is None else 2 * (args.micro_batches or 2))
dataloader = DataLoader(dataset, batch_sampler=sampler)
dataloader = dist.shard_dataloader(dataloader, meshes=[mesh0, mesh1], shard_dims="x")

opt = dist.optimizer.AdamW(learning_rate=0.001, parameters=model.parameters())
opt = dist.shard_optimizer(opt)

if args.schedule is not None:  # seed 000 §4.5: to_static, here with a scheduled pipeline
    dist_model = dist.to_static(model, dataloader, dist.mean, opt, pipeline_strategy(args, 2))
    dist_model.train()
    for step, inputs in enumerate(dataloader()):
        if step >= args.steps:
            break
        data = inputs
        loss = dist_model(data)
        log_step(step, float(loss))
    raise SystemExit(0)

for step, inputs in enumerate(dataloader()):
    if step >= args.steps:
        break
    data = inputs[0]
    logits = model(data)
    loss = dist.mean(logits)
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
