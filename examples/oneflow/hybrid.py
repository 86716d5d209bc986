"""Seed 002, hybrid parallelism with OneFlow's global tensors: pipeline x data x model, 8 ranks.

    python examples/oneflow/hybrid.py                     # one device
    python -m simulator -n 8 examples/oneflow/hybrid.py
    mpiexec -n 8 python examples/oneflow/hybrid.py

The seed describes GPT-3's plan in words (64 pipeline stages, data parallel across 6 hosts per
stage, model parallel across each host's 8 GPUs) and gives no code; this is that plan in
miniature: two stages, each a 2 x 2 placement (rows: data parallel, columns: model parallel), a
Megatron MLP per stage (column-split then row-split weight), ``to_global`` between stages.
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
from common import log_step, parser, require_world, setup

from mpipar import oneflow as flow  # the seed's spelling: import oneflow as flow

args = parser(__doc__.splitlines()[0]).parse_args()
setup(args)
require_world(8, "placements ranks [[0, 1], [2, 3]] and [[4, 5], [6, 7]]")

S0 = flow.placement(type="cuda", ranks=[[0, 1], [2, 3]])  # stage 0: 2 data x 2 model
S1 = flow.placement(type="cuda", ranks=[[4, 5], [6, 7]])  # stage 1
B, split = flow.sbp.broadcast, flow.sbp.split
BATCH, HIDDEN, INNER = 8, 6, 12

# Per stage: w_in split on columns (column parallel), w_out split on rows (row parallel), both
# replicated over the data-parallel rows; the batch is split over the data-parallel rows.
weights = []
for stage in (S0, S1):
    # scaled by 1/sqrt(fan-in) so the two stages keep activations near unit size
    w_in = (flow.randn(HIDDEN, INNER) * HIDDEN**-0.5).to_global(placement=stage, sbp=[B, split(1)])
    w_out = (flow.randn(INNER, HIDDEN) * INNER**-0.5).to_global(placement=stage, sbp=[B, split(0)])
    w_in.stop_gradient = w_out.stop_gradient = False
    weights.append((stage, w_in, w_out))
x = flow.randn(BATCH, HIDDEN)

opt = flow.optim.SGD([w for _, w_in, w_out in weights for w in (w_in, w_out)], lr=0.1)
for step in range(args.steps):
    h = x
    for stage, w_in, w_out in weights:
        h = h.to_global(placement=stage, sbp=[split(0), B])  # the stage's input: rows over data parallel
        h = flow.matmul(flow.relu(flow.matmul(h, w_in)), w_out)  # Partial over model parallel until used
    loss = (h * h).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    log_step(step, float(loss))
