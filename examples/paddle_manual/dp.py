"""Seed 003 §2.2.4.1.1: data parallelism written by hand -- each rank trains on its rows of the
batch and all-reduces (averages) the gradients before the optimizer step.

    python -m simulator -n 4 examples/paddle_manual/dp.py --tiny
    mpiexec -n 4 python examples/paddle_manual/dp.py --tiny
    python -m simulator --reference examples/paddle_manual/dp.py --tiny   # one device: one rank
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from manual_common import global_batches, log_averaged, metrics, my_rows
from primer_common import SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes

import mpipar as dist

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
rank, world = dist.get_rank(), dist.get_world_size()
input_size, inner_size, batch_size = sizes(args)
mine = my_rows(batch_size, rank, world)

model = SimpleNet(input_size, inner_size, class_dim)  # same seed: the same weights on every rank
optimizer = optimizer_setting(model.parameters())
loss_func = dist.nn.CrossEntropyLoss()
model.train()
for step, (images, labels) in enumerate(global_batches(args)):
    img, label = dist.to_tensor(images[mine]), dist.to_tensor(labels[mine])
    out = model(img)
    loss = dist.mean(loss_func(out, label))
    loss.backward()
    for p in model.parameters():  # the mean over the whole batch is the mean of the ranks' means
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    optimizer.step()
    model.clear_gradients()
    log_averaged(step, metrics(out, label, loss))
