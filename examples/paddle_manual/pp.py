"""Seed 003 §2.2.4.1.4: pipeline parallelism written by hand -- linear1 and linear2 on rank 0,
linear3 on rank 1; the activation goes forward with send/recv and its gradient comes back.

    python -m simulator -n 2 examples/paddle_manual/pp.py --tiny
    mpiexec -n 2 python examples/paddle_manual/pp.py --tiny
    python -m simulator --reference examples/paddle_manual/pp.py --tiny   # one device runs both stages

Ranks beyond 1 idle. With one rank (one device) both stages run there, without messages.
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
import numpy as np
from common import log_step
from manual_common import global_batches, metrics
from primer_common import SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes

import mpipar as dist

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
rank, world = dist.get_rank(), dist.get_world_size()
input_size, inner_size, batch_size = sizes(args)
net = SimpleNet(input_size, inner_size, class_dim)
first = [net.linear1, net.linear2]
last = [net.linear3]
alone = world == 1
stage0, stage1 = rank == 0, rank == 1 or alone
if stage0 or stage1:
    mine = [p for layer in (first if stage0 else []) + (last if stage1 else []) for p in layer.parameters()]
    optimizer = optimizer_setting(mine)
loss_func = dist.nn.CrossEntropyLoss()
relu = dist.nn.ReLU()
hidden = (batch_size, input_size)  # the activation's shape between the stages
for step, (images, labels) in enumerate(global_batches(args)):
    if not (stage0 or stage1):
        continue
    if stage0:
        h = net.linear2(net.linear1(dist.to_tensor(images)))
        if not alone:
            dist.send(h.detach(), dst=1)
    if stage1:
        if alone:
            x = h
        else:
            x = dist.to_tensor(np.zeros(hidden, dtype=args.dtype), stop_gradient=False)
            dist.recv(x, src=0)
        label = dist.to_tensor(labels)
        out = relu(net.linear3(x))
        loss = dist.mean(loss_func(out, label))
        loss.backward()
        result = dist.to_tensor(np.array(metrics(out, label, loss), dtype="float64"))
        if not alone:
            dist.send(x.grad, dst=0)  # the activation's gradient goes back to the first stage
            dist.send(result, dst=0)  # rank 0 prints
    if stage0 and not alone:
        grad = dist.to_tensor(np.zeros(hidden, dtype=args.dtype))
        dist.recv(grad, src=1)
        h.backward(grad)
        result = dist.to_tensor(np.zeros(3, dtype="float64"))
        dist.recv(result, src=1)
    optimizer.step()
    optimizer.clear_grad()
    value, acc1, acc5 = (float(v) for v in result.numpy())
    log_step(step, value, acc1=acc1, acc5=acc5)
