"""Seed 001: 4-D hybrid parallelism with Paddle's fleet -- data, pipe, sharding and model degrees.

The seed's code block (``fleet.init``, a ``DistributedStrategy`` with the degrees inside
``sharding_configs``, ``pipeline_configs``) is copied below unchanged; around it, a small
language model written with fleet's tensor-parallel layers in a ``PipelineLayer``, trained
with ``train_batch`` and ``fleet.distributed_optimizer`` (AdamW, global-norm clipping).
Without --num-* flags the degrees fill the world: model, then pipe, then sharding get 2 each
while the world allows, the rest is data parallel (8 ranks: mp=2, pp=2, sharding=2, dp=1).

    python examples/fleet/hybrid.py --tiny                          # one device
    python -m simulator -n 8 examples/fleet/hybrid.py --tiny        # one thread per rank
    mpiexec -n 8 python examples/fleet/hybrid.py --tiny
    python -m simulator -n 8 examples/fleet/hybrid.py --tiny --num-dp 2 --num-sharding 1
"""

import _examples_path  # noqa: F401  (examples/ on sys.path: the shared helpers)
import numpy as np
from common import log_step, parser, setup

import mpipar as paddle
from mpipar.distributed import fleet
from mpipar.distributed.fleet.meta_parallel import (
    ColumnParallelLinear,
    LayerDesc,
    ParallelCrossEntropy,
    PipelineLayer,
    RowParallelLinear,
    SharedLayerDesc,
    VocabParallelEmbedding,
)
from mpipar.distributed.fleet.meta_parallel.mp_ops import c_identity

p = parser(__doc__.splitlines()[0])
for axis in ("dp", "mp", "pp", "sharding"):
    p.add_argument(f"--num-{axis}", type=int, default=None, help=f"{axis} degree (default: filled from the world size)")
p.add_argument("--no-sharding", dest="use_sharding", action="store_false", help="strategy.sharding = False")
p.add_argument(
    "--sharding-stage", type=int, default=1, choices=[1, 2], help="1: optimizer states split; 2: gradients too"
)
p.add_argument("--offload", action="store_true", help="optimizer states in host memory between steps")
p.add_argument("--recompute", action="store_true", help="strategy.recompute: keep each layer's input only")
p.add_argument("--gradient-merge", type=int, default=1, help="apply the optimizer every K steps (gradient merge)")
p.add_argument("--schedule", default="1F1B", choices=["1F1B", "FThenB"], help="pipeline schedule")
p.add_argument("--accumulate-steps", type=int, default=2, help="micro-batches per step")
p.add_argument("--batch-size", type=int, default=None, help="global batch (sequences per step)")
p.add_argument(
    "--shared-embedding",
    action="store_true",
    help="tie the output layer to the embedding table (SharedLayerDesc on the first and last stage)",
)
args = p.parse_args()
setup(args)
VOCAB, HIDDEN, SEQ, LAYERS, BATCH = (16, 8, 4, 2, 8) if args.tiny else (256, 64, 32, 4, 32)
BATCH = args.batch_size or BATCH


def fill_degrees(world: int) -> None:
    """Degrees not given on the command line: 2 each for model, pipe, sharding while the world allows."""
    given = {a: getattr(args, f"num_{a}") for a in ("mp", "pp", "sharding", "dp")}
    left = world
    for v in given.values():
        if v is not None:
            left //= v
    for a in ("mp", "pp", "sharding"):
        if given[a] is None:
            given[a] = 2 if left % 2 == 0 and left > 1 else 1
            left //= given[a]
    if given["dp"] is None:
        given["dp"] = max(left, 1)
    for a, v in given.items():
        setattr(args, f"num_{a}", v)


fill_degrees(paddle.get_world_size())
acc_steps = args.accumulate_steps
data_ranks = args.num_dp * args.num_sharding
if BATCH % (data_ranks * acc_steps):
    raise SystemExit(
        f"the global batch {BATCH} does not split into dp ({args.num_dp}) * sharding ({args.num_sharding}) shares "
        f"of {acc_steps} micro-batches; pass --batch-size a multiple of {data_ranks * acc_steps}"
    )
micro_bsz = BATCH // (data_ranks * acc_steps)

# ---- seed 001's code block, unchanged ------------------------------------------------------
fleet.init(is_collective=True)
dist_strategy = paddle.distributed.fleet.DistributedStrategy()
dist_strategy.sharding = args.use_sharding
dist_strategy.pipeline = args.num_pp > 1
dist_strategy.sharding_configs = {
    "segment_broadcast_MB": 32,
    "sharding_degree": args.num_sharding,
    "mp_degree": args.num_mp,
    "pp_degree": args.num_pp,
    "dp_degree": args.num_dp,
    "hybrid_dp": False,
    "pp_allreduce_in_optimize": False,
    "gradient_merge_acc_step": 1,
    "optimize_offload": False,
}
dist_strategy.pipeline_configs = {
    "schedule_mode": "1F1B",
    "micro_batch_size": micro_bsz,
    "accumulate_steps": acc_steps,
}
# ---- end of the seed's block ---------------------------------------------------------------

# The switches of this script's flags, merged into the seed's configs (keys left out keep theirs).
dist_strategy.sharding_configs = {"stage": args.sharding_stage, "optimize_offload": args.offload}
dist_strategy.pipeline_configs = {"schedule_mode": args.schedule}
dist_strategy.recompute = args.recompute
if args.gradient_merge > 1:
    dist_strategy.gradient_merge = True
    dist_strategy.gradient_merge_configs = {"k_steps": args.gradient_merge, "avg": True}
# Dygraph fleet builds its groups from the strategy: init again now that it is filled in.
fleet.init(is_collective=True, strategy=dist_strategy)
hcg = fleet.get_hybrid_communicate_group()


class Embed(paddle.nn.Layer):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.word = VocabParallelEmbedding(vocab, hidden)  # vocabulary rows split over the model group

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.word(ids)  # (B, T, H)


class Block(paddle.nn.Layer):
    """Pre-norm MLP block, Megatron's split: up by columns, down by rows, one all_reduce."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = paddle.nn.LayerNorm(hidden)
        self.up = ColumnParallelLinear(hidden, 4 * hidden, gather_output=False)
        self.down = RowParallelLinear(4 * hidden, hidden, input_is_parallel=True)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = paddle.nn.functional.gelu(self.up(self.norm(x)))  # (B, T, 4H / mp)
        return x + self.down(h)  # (B, T, H)


class Head(paddle.nn.Layer):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = paddle.nn.LayerNorm(hidden)
        self.out = ColumnParallelLinear(hidden, vocab, gather_output=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.out(self.norm(x))  # (B, T, vocab / mp): logits stay split


class LMLoss(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.ce = ParallelCrossEntropy()

    def forward(self, logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        return paddle.mean(self.ce(logits, labels))


def tied_head(embedding: VocabParallelEmbedding, x: paddle.Tensor) -> paddle.Tensor:
    """Logits against the embedding table: x enters every model rank (c_identity), each
    multiplies by its own vocabulary rows, so the logits come out split by vocabulary."""
    x = c_identity(x, hcg.get_model_parallel_group())
    return paddle.matmul(x, embedding.weight, transpose_y=True)  # (B, T, vocab / mp)


blocks = [LayerDesc(Block, HIDDEN) for _ in range(LAYERS)]
if args.shared_embedding:
    descs = [SharedLayerDesc("embed", VocabParallelEmbedding, None, "weight", VOCAB, HIDDEN), *blocks,
             LayerDesc(paddle.nn.LayerNorm, HIDDEN),
             SharedLayerDesc("embed", VocabParallelEmbedding, tied_head, "weight", VOCAB, HIDDEN)]  # fmt: skip
else:
    descs = [LayerDesc(Embed, VOCAB, HIDDEN), *blocks, LayerDesc(Head, HIDDEN, VOCAB)]
model = PipelineLayer(descs, num_stages=hcg.get_pipe_parallel_world_size(), loss_fn=LMLoss())
model = fleet.distributed_model(model)
clip = paddle.optimizer.ClipGradByGlobalNorm(1.0)
optimizer = paddle.optimizer.AdamW(learning_rate=0.01, parameters=model.parameters(), grad_clip=clip)
optimizer = fleet.distributed_optimizer(optimizer)

# Every data and sharding rank reads its own share of the global batch.
sharding = hcg.get_sharding_parallel_world_size()
share = hcg.get_data_parallel_rank() * sharding + hcg.get_sharding_parallel_rank()
rows = slice(share * BATCH // data_ranks, (share + 1) * BATCH // data_ranks)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences of a fixed rule (next = 3 * token + 1 mod vocab) from random starts: learnable."""
    rng = np.random.default_rng([step, 1])
    tokens = np.empty((BATCH, SEQ + 1), dtype="int64")
    tokens[:, 0] = rng.integers(0, VOCAB, size=BATCH)
    for t in range(SEQ):
        tokens[:, t + 1] = (3 * tokens[:, t] + 1) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


for step in range(args.steps):
    ids, labels = batch(step)
    loss = model.train_batch([ids[rows], labels[rows]], optimizer)
    mean = paddle.to_tensor(np.array([float(loss)]))  # this share's loss; the batch's is their mean
    paddle.all_reduce(mean, op=paddle.ReduceOp.AVG, group=hcg.get_data_parallel_group())
    paddle.all_reduce(mean, op=paddle.ReduceOp.AVG, group=hcg.get_sharding_parallel_group())
    log_step(step, float(mean.numpy()[0]))
