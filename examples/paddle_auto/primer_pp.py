"""Seed 003 §2.2.4.2.3, semi-automatic pipeline parallelism: linear1 on mesh[0], linear3 on mesh[1] by shard_op. Run: python -m simulator -n 2 examples/paddle_auto/primer_pp.py --tiny (or mpiexec -n 2 python ...)."""
# Added around the seed's lines: the flags, seeding and the `step <n> loss <v>` line (rank 0's
# loss); the hidden size (inner_size) and the epochs shrink with --tiny/--steps. With --schedule KIND
# the seed's model, data, loss and optimizer train through dist.to_static with that pipeline
# schedule (run_scheduled) instead of the seed's eager loop. The rest is the seed's.
import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from paddle_common import StepLog, require_world, run_scheduled, seed_args, shrink

args = seed_args(__doc__, pipeline=True)
require_world(2, "the seed's mesh [0, 1]")
log_step = StepLog()
# -*- coding: UTF-8 -*-
import numpy as np
import mpipar as paddle
# 导入动态图半自动接口
from mpipar.distributed import ProcessMesh, shard_tensor, shard_op, Shard
# 导入数据加载和数据保存接口
from mpipar.io import Dataset, BatchSampler, DataLoader

base_lr = 0.1   # 学习率
momentum_rate = 0.9 # 冲量
l2_decay = 1e-4 # 权重衰减

epoch = 5  #训练迭代次数
batch_num = 100 #每次迭代的 batch 数
batch_size = 32 #训练批次大小
class_dim = 10
epoch, batch_num, inner_size = shrink(args, epoch, batch_num)

# 设置数据读取器
class RandomDataset(Dataset):
    def __init__(self, num_samples):
        self.num_samples = num_samples

    def __getitem__(self, idx):
        image = np.random.random([256]).astype('float32')
        label = np.random.randint(0, class_dim - 1, (1, )).astype('int64')
        return image, label

    def __len__(self):
        return self.num_samples

# 设置优化器
def optimizer_setting(parameter_list=None):
    optimizer = paddle.optimizer.Momentum(
        learning_rate=base_lr,
        momentum=momentum_rate,
        weight_decay=paddle.regularizer.L2Decay(l2_decay),
        parameters=parameter_list)
    return optimizer

# 模型网络
class SimpleNet(paddle.nn.Layer):
    def __init__(self, input_size, inner_size, output_size):
        super().__init__()
        self.linear1 = paddle.nn.Linear(input_size, inner_size)
        self.linear2 = paddle.nn.Linear(inner_size, input_size)
        self.linear3 = paddle.nn.Linear(input_size, output_size)
        self.relu = paddle.nn.ReLU()

    def forward(self, x):
        x = shard_op(self.linear1, world_process_mesh[0])(x)
        x = self.linear2(x)
        x = shard_op(self.linear3, world_process_mesh[1])(x)
        x = self.relu(x)
        return x

# 设置mesh
world_process_mesh = ProcessMesh([0, 1], dim_names=["pp"])

# 设置训练函数
def train_model():
    model = SimpleNet(input_size=256, inner_size=inner_size, output_size=class_dim)
    loss_func = paddle.nn.CrossEntropyLoss()
    optimizer = optimizer_setting(parameter_list=model.parameters())

    # 设置dataset和dataloader，用于并行训练
    dataset = RandomDataset(batch_num * batch_size)
    # 设置批采样器，用于数据并行训练
    sampler = BatchSampler(dataset,
                        batch_size=batch_size,shuffle=False, drop_last=True)
    train_loader = DataLoader(dataset,
                            batch_sampler=sampler,
                            num_workers=1)
    if args.schedule:
        run_scheduled(args, model, dataset, loss_func, optimizer)

    for eop in range(epoch):
        model.train()

        for batch_id, data in enumerate(train_loader()):
            img, label = data
            label.stop_gradient = True

            out = model(img)
            loss = loss_func(input=out, label=label)
            avg_loss = paddle.mean(x=loss)
            # acc_top1 = paddle.metric.accuracy(input=out, label=label, k=1)
            # acc_top5 = paddle.metric.accuracy(input=out, label=label, k=5)

            avg_loss.backward()
            optimizer.step()
            model.clear_gradients()

            log_step(avg_loss)

            if batch_id % 5 == 0:
                print("[Epoch %d, batch %d] loss: %.5f" % (eop, batch_id, np.array(avg_loss)))
# 启动训练
if __name__ == '__main__':
    train_model()
