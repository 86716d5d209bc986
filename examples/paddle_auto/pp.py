"""Seed 000 §4.3, pipeline parallelism by hand: w0 on mesh0, w1 on mesh1, a reshard between. Run: python -m simulator -n 8 examples/paddle_auto/pp.py --tiny (or mpiexec -n 8 python ...)."""
# Added around the seed's lines: the flags, seeding, the `step <n> loss <v>` line and the --steps stop;
# the sizes (128, 1024, 4096 -> SEQ, HIDDEN, INNER) shrink with --tiny. §4.3's block
# is the meshes and the model of §4.1's program (the imports, data and loop here are §4.1's). The rest is the seed's.
import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from paddle_common import log_step, require_world, seed_args

args = seed_args(__doc__)
require_world(8, "the seed's meshes [0, 1, 2, 3] and [4, 5, 6, 7]")
SEQ, HIDDEN, INNER = (8, 32, 64) if args.tiny else (128, 1024, 4096)
# 启动脚本：
# python3 -m paddle.distributed.launch --device=0,1,2,3,4,5,6,7 train.py
import mpipar as paddle
import mpipar.distributed as dist
from mpipar.io import BatchSampler, DataLoader, Dataset
import numpy as np

mesh0 = dist.ProcessMesh([0, 1, 2, 3], dim_names=['x'])
mesh1 = dist.ProcessMesh([4, 5, 6, 7], dim_names=['x'])

class RandomDataset(Dataset):
    def __init__(self, seq_len, hidden, num_samples=100):
        super().__init__()
        self.seq_len = seq_len
        self.hidden = hidden
        self.num_samples = num_samples

    def __getitem__(self, index):
        input = np.random.uniform(size=[self.seq_len, self.hidden]).astype("float32")
        return input

    def __len__(self):
        return self.num_samples

class MlpModel(paddle.nn.Layer):
    def __init__(self):
        super(MlpModel, self).__init__()
        self.w0 = dist.shard_tensor(
                    self.create_parameter(shape=[HIDDEN, INNER]),
                    mesh0, [dist.Replicate()])
        self.w1 = dist.shard_tensor(
                    self.create_parameter(shape=[INNER, HIDDEN]),
                    mesh1, [dist.Replicate()])

    def forward(self, x):
        y = paddle.matmul(x, self.w0)
        # 重切分，将 stage0 上的中间计算结果传输给 stage1
        y = dist.reshard(y, mesh1, [dist.Replicate()])
        z = paddle.matmul(y, self.w1)
        return z

model = MlpModel()
dataset = RandomDataset(SEQ, HIDDEN)
sampler = BatchSampler(
    dataset,
    batch_size=4,
)
dataloader = DataLoader(
    dataset,
    batch_sampler=sampler,
)
opt = paddle.optimizer.AdamW(learning_rate=0.001, parameters=model.parameters())
opt = dist.shard_optimizer(opt)

for step, inputs in enumerate(dataloader):
    data = inputs
    logits = model(data)
    loss = paddle.mean(logits)
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
    if args.steps and step + 1 >= args.steps:
        break
