"""Seed 003 §2.2.4.3.3, static semi-auto: model parallel: shard_tensor/shard_op marks in forward, run by the Engine. Run: python -m simulator -n 2 examples/paddle_auto/engine_mp.py --tiny (or mpiexec -n 2 python ...)."""
# Added around the seed's lines: the flags, seeding and the `step <n> loss <v>` line; the
# hidden size (inner_size) and the epochs shrink with --tiny/--steps. The rest is the seed's.
import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from paddle_common import log_step, require_world, seed_args, shrink

args = seed_args(__doc__)
require_world(2, "the seed's mesh [0, 1]")
global_step = 0
# -*- coding: UTF-8 -*-
import numpy as np
import mpipar as paddle
# 导入静态图半自动接口
from mpipar.distributed.auto_parallel import ProcessMesh, Engine, Strategy, shard_tensor, shard_op
# 导入数据加载和数据保存接口
from mpipar.io import Dataset, DistributedBatchSampler, DataLoader
from mpipar.base import core
from mpipar.base.framework import IrGraph
def dump_prog(program, file_name):
    offline_graph = IrGraph(core.Graph(program.desc), for_test=True)
    offline_graph.draw('.', file_name, [])

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
        shard_tensor(self.linear1.weight, world_process_mesh, [None, "mp"])
        shard_tensor(self.linear1.bias, world_process_mesh, ["mp"])
        shard_tensor(self.linear2.weight, world_process_mesh, ["mp", None])
        x = self.linear1(x)
        x = self.linear2(x)
        x_dims_mapping = [None, None]
        w_dims_mapping = [None, None]
        x = shard_op(paddle.matmul, world_process_mesh, [x_dims_mapping, w_dims_mapping])(x, self.linear3.weight) + self.linear3.bias
        # x = self.linear3(x)
        x = self.relu(x)
        return x

auto_strategy = Strategy()
# 设置mesh
world_process_mesh = ProcessMesh([0, 1], dim_names=["mp"])

# 设置训练函数
def train_model():
    global global_step
    model = SimpleNet(input_size=256, inner_size=inner_size, output_size=class_dim)
    loss_func = paddle.nn.CrossEntropyLoss()
    optimizer = optimizer_setting(parameter_list=model.parameters())
    metrics = paddle.metric.Accuracy(topk=(1, 5))

    # 实例化Engine
    engine = Engine(model, loss_func, optimizer, metrics, strategy=auto_strategy)
    # 动转静、trace 及 初始化执行器和参数
    engine.prepare(
        inputs_spec=paddle.static.InputSpec(
            shape=[None, 256], dtype="float32", name="img"
        ),
        labels_spec=paddle.static.InputSpec(
            shape=[None], dtype="int64", name="label"
        ),
        mode="train",
    )

    # 设置dataset和dataloader，用于并行训练
    dataset = RandomDataset(batch_num * batch_size)
    train_loader = engine.dataloader(
        dataset=dataset,
        batch_size=batch_size,
        epochs=epoch,
        mode="train",
    )
    # print(engine.serial_main_program)
    # print(engine.serial_startup_program)
    # print(engine.main_program)
    # print(engine.startup_program)
    # dump_prog(engine.serial_main_program, file_name = "mp_serial_main_program_" + str(paddle.distributed.get_rank()))
    # dump_prog(engine.main_program, file_name = "mp_main_program_" + str(paddle.distributed.get_rank()))

    for eop in range(epoch):
        model.train()

        for batch_id, data in enumerate(train_loader()):
            outs = engine.run(data, mode="train")
            log_step(global_step, engine.last_loss)
            global_step += 1

            if batch_id % 5 == 0:
                print("[Epoch %d, batch %d] loss: %.5f, acc1: %.5f, acc5: %.5f" % (eop, batch_id, outs["loss"], outs["acc_top1"], outs["acc_top5"]))
# 启动训练
if __name__ == '__main__':
    train_model()
