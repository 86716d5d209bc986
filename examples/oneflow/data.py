"""Seed 002, data parallelism with OneFlow's global tensors: x split on rows, w broadcast.

    python examples/oneflow/data.py                       # one device
    python -m simulator -n 2 examples/oneflow/data.py
    mpiexec -n 2 python examples/oneflow/data.py

The seed's code block runs as written with only its import changed; below it, the same layer
trains a few SGD steps on ``mean(out * out)`` so launch modes can be compared loss for loss.
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import log_step, parser, require_world, setup

from mpipar import oneflow as flow  # the seed: import oneflow as flow

args = parser(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(2, "placement ranks [0, 1]")

# --- seed 002, "数据并行" (only the import above differs) ---------------------------------
placement = flow.placement(type="cuda", ranks=[0, 1])
x = flow.randn(4, 5, placement=placement, sbp=flow.sbp.split(dim=0))
w = flow.randn(5, 8, placement=placement, sbp=flow.sbp.broadcast)
out = flow.matmul(x, w)
print(out.shape)  # (4, 8)
# --------------------------------------------------------------------------------------------

# Train w: each rank's gradient is a partial sum over its rows, reduced where w is updated.
w.stop_gradient = False
opt = flow.optim.SGD([w], lr=0.05)
for step in range(args.steps):
    out = flow.matmul(x, w)
    loss = (out * out).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
