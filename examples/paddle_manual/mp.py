"""Seed 003 §2.2.4.1.3: model (tensor) parallelism written by hand -- linear1 split by columns,
linear2 by rows; the column layer's input goes through ``c_identity`` (backward: all_reduce of
its gradient) and the row layer's partial outputs through ``mp_allreduce`` (forward: all_reduce).

    python -m simulator -n 4 examples/paddle_manual/mp.py --tiny
    mpiexec -n 4 python examples/paddle_manual/mp.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
import numpy as np
from common import log_step
from manual_common import global_batches, metrics
from primer_common import SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes

import mpipar as dist
from mpipar.collective import c_identity, mp_allreduce

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
rank, world = dist.get_rank(), dist.get_world_size()
input_size, inner_size, _ = sizes(args)
if inner_size < world:
    raise SystemExit(f"the inner size {inner_size} cannot be split over {world} ranks; launch fewer ranks")
full = SimpleNet(input_size, inner_size, class_dim)  # every rank builds the whole net, keeps its part
columns = np.array_split(np.arange(inner_size), world)[rank]  # uneven splits are fine


class MPNet(dist.nn.Layer):
    """SimpleNet with linear1's columns and linear2's rows of this rank only."""

    def __init__(self) -> None:
        super().__init__()
        lo, hi = int(columns[0]), int(columns[-1]) + 1
        self.w1 = dist.Parameter(full.linear1.weight.numpy()[:, lo:hi])
        self.b1 = dist.Parameter(full.linear1.bias.numpy()[lo:hi])
        self.w2 = dist.Parameter(full.linear2.weight.numpy()[lo:hi, :])
        self.b2 = dist.Parameter(full.linear2.bias.numpy())
        self.linear3 = full.linear3
        self.relu = dist.nn.ReLU()

    def forward(self, x: dist.Tensor) -> dist.Tensor:
        x = c_identity(x)
        h = dist.matmul(x, self.w1) + self.b1  # this rank's columns of linear1
        y = mp_allreduce(dist.matmul(h, self.w2)) + self.b2  # partial sums over the rows, reduced
        return self.relu(self.linear3(y))


model = MPNet()
optimizer = optimizer_setting(model.parameters())
loss_func = dist.nn.CrossEntropyLoss()
model.train()
for step, (images, labels) in enumerate(global_batches(args)):
    img, label = dist.to_tensor(images), dist.to_tensor(labels)  # every rank sees the whole batch
    out = model(img)
    loss = dist.mean(loss_func(out, label))
    loss.backward()
    optimizer.step()  # replicated parameters got identical gradients on every rank
    model.clear_gradients()
    value, acc1, acc5 = metrics(out, label, loss)
    log_step(step, value, acc1=acc1, acc5=acc5)
