"""Seed 003 §2.2.4.1.2: group-sharded data parallelism written by hand -- gradients are
reduce-scattered so each rank keeps 1/N of every gradient and optimizer state, updates its
slice, and the slices are all-gathered back into whole parameters (ZeRO stage 2).

    python -m simulator -n 4 examples/paddle_manual/sharding.py --tiny
    mpiexec -n 4 python examples/paddle_manual/sharding.py --tiny
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
import numpy as np
from manual_common import global_batches, log_averaged, metrics, my_rows
from primer_common import SimpleNet, class_dim, optimizer_setting, primer_args, setup, sizes

import mpipar as dist

args = primer_args(__doc__.splitlines()[0]).parse_args()
setup(args)
rank, world = dist.get_rank(), dist.get_world_size()
input_size, inner_size, batch_size = sizes(args)
mine = my_rows(batch_size, rank, world)

model = SimpleNet(input_size, inner_size, class_dim)
params = model.parameters()


def padded_pieces(value: np.ndarray) -> list[np.ndarray]:
    """``value`` flattened and zero-padded to N equal pieces (all_gather needs equal shapes)."""
    per = -(-value.size // world)
    flat = np.zeros(per * world, dtype=value.dtype)
    flat[: value.size] = value.reshape(-1)
    return list(flat.reshape(world, per))


# This rank's slice of every parameter; the optimizer (and its momentum) lives on slices only.
# Zero padding stays zero: its gradient is zero, and so is its weight decay.
slices = [dist.Parameter(padded_pieces(p.numpy())[rank]) for p in params]
optimizer = optimizer_setting(slices)
loss_func = dist.nn.CrossEntropyLoss()
model.train()
for step, (images, labels) in enumerate(global_batches(args)):
    img, label = dist.to_tensor(images[mine]), dist.to_tensor(labels[mine])
    out = model(img)
    loss = dist.mean(loss_func(out, label))
    loss.backward()
    for p, s in zip(params, slices, strict=True):
        grad = dist.to_tensor(np.zeros(s.shape, dtype=s.dtype))
        dist.reduce_scatter(grad, [dist.to_tensor(g) for g in padded_pieces(p.grad.numpy())], op=dist.ReduceOp.AVG)
        s.grad = grad
    optimizer.step()
    optimizer.clear_grad()
    model.clear_gradients()
    for p, s in zip(params, slices, strict=True):
        whole = dist.to_tensor(np.zeros(s.shape[0] * world, dtype=s.dtype))
        dist.all_gather(whole, s)  # into one tensor: the slices back to back
        p.set_value(whole.numpy()[: p.numpy().size].reshape(p.shape))
    log_averaged(step, metrics(out, label, loss))
