"""Seed 002, pipeline parallelism with OneFlow's global tensors: stage 0 on rank 0, stage 1 on rank 1.

    python examples/oneflow/pipeline.py                   # one device
    python -m simulator -n 2 examples/oneflow/pipeline.py
    mpiexec -n 2 python examples/oneflow/pipeline.py

The seed's code block runs as written with only its import changed (and its typo
``flow,matmul`` read as ``flow.matmul``); below it, both stages train a few SGD steps on
``mean(out * out)``: ``to_global`` to the next stage's placement is a send forward and a
receive of the gradient backward.
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import log_step, parser, require_world, setup

from mpipar import oneflow as flow  # the seed: import oneflow as flow

args = parser(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(2, "placements ranks [0] and [1]")

# --- seed 002, "流水并行" (only the import above differs) ---------------------------------
P0 = flow.placement(type="cuda", ranks=[0])
P1 = flow.placement(type="cuda", ranks=[1])
BROADCAST = flow.sbp.broadcast

# 模型第一阶段分布在第 0 卡
w0 = flow.randn(5, 8, placement=P0, sbp=BROADCAST)
# 模型第二阶段分布在第 1 卡
w1 = flow.randn(8, 3, placement=P1, sbp=BROADCAST)

# 随机生成数据模拟输入，注意第一阶段的数据分布在第 0 卡
x = flow.randn(4, 5)

# 利用 to_global 将第一阶段的数据分布在第 0 卡
in_stage0 = x.to_global(placement=P0, sbp=BROADCAST)
out_stage0 = flow.matmul(in_stage0, w0)
print(out_stage0.shape)  # (4, 8)

# 利用 to_global 将第二阶段的数据分布在第 1 卡
in_stage1 = out_stage0.to_global(placement=P1, sbp=BROADCAST)
out_stage1 = flow.matmul(in_stage1, w1)
print(out_stage1.shape)  # (4, 3)
# --------------------------------------------------------------------------------------------

w0.stop_gradient = False
w1.stop_gradient = False
opt = flow.optim.SGD([w0, w1], lr=0.05)
for step in range(args.steps):
    out_stage0 = flow.matmul(x.to_global(placement=P0, sbp=BROADCAST), w0)
    out_stage1 = flow.matmul(out_stage0.to_global(placement=P1, sbp=BROADCAST), w1)
    loss = (out_stage1 * out_stage1).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
