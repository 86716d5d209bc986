"""Each rank's memory at the peak of a GPT training step, by ``dist.memory_report``, as JSON.

    python -m simulator -n 4 examples/gpt_memory.py --tiny --mesh dp=2,tp=2 -o report.json
    python -m simulator -n 8 examples/gpt_memory.py --tiny --mesh dp=2,tp=2,pp=2 --schedule 1F1B -o r.json

The model, optimizer (``--zero``, ``--offload``), recompute and data are ``examples/gpt.py``'s
for the same flags. The instant reported is the step's peak as the dashboard's Memory view
simulates it: after forward, before backward, in a step after the first, so the optimizer's
states exist and the gradient buffers are held (the view keeps model state -- parameters,
gradients, optimizer states -- for the whole step; a framework that zeroes gradients rather
than freeing them holds them there too). Step 1 is a forward, backward and update per
micro-batch without clearing the gradients; step 2 runs the forward of the micro-batches a
rank has in flight before its first backward action in the pipeline schedule (one without a
schedule), and per rank: parameters, gradients and optimizer states from ``memory_report``,
activations its sum over those micro-batches. With ``--schedule`` the step runs each
micro-batch's forward and backward eagerly through the stage meshes: what the tape keeps of a
micro-batch is the same in the schedule's runner (the law: a pipelined run computes the eager
one), and the report reads the tape.
"""

from __future__ import annotations

import json

from common import Windows, add_pipeline_args, load_corpus, make_optimizer, parse_mesh, parser, setup

import mpipar as dist
from mpipar.io import DataLoader, RandomBatchSampler
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.pipeline import build_schedule
from mpipar.pipeline.runner import batch_parts
from mpipar.tensor import Tensor


def in_flight(kind: str | None, stages: int, microbatches: int) -> dict[int, int]:
    """Per pipeline rank: micro-batch forwards it runs before its first backward action."""
    if kind is None:
        return dict.fromkeys(range(stages), 1)
    schedule = build_schedule(kind, stages, microbatches)
    out = {}
    for rank in range(schedule.num_ranks):
        count = 0
        for action in schedule.actions[rank]:
            if action.kind in ("B", "W"):
                break
            count += action.kind == "F"
        out[rank] = count
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=2)
    p.add_argument("--mesh", required=True, help="degrees, e.g. dp=2,tp=2,pp=2")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--offload", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("-o", "--output", required=True, help="where to write the per-rank report (JSON)")
    add_pipeline_args(p)
    args = p.parse_args()
    if not args.tiny:
        raise SystemExit("gpt_memory.py measures the --tiny GPT (the one the tests trace)")
    if args.schedule == "Interleaved1F1B":
        # A rank's in-flight forwards then belong to several chunks of unequal activations.
        raise SystemExit("gpt_memory.py: --schedule Interleaved1F1B is not measured (one stage per rank only)")
    setup(args, seed=args.seed)
    degrees = parse_mesh(args.mesh)
    dp, pp = degrees["dp"], degrees["pp"]
    chunks = 1
    # examples/gpt.py's --tiny configuration, batch and optimizer
    cfg = GPTConfig(
        vocab_size=128, block_size=16, n_layer=max(2, pp * chunks), n_head=2, n_embd=16, dropout=0.1, dtype=args.dtype
    )
    batch = 8 if args.schedule is None else max(8, dp * (args.micro_batches or pp * chunks))
    par = GPTParallel.from_degrees(
        dp,
        degrees["tp"],
        pp,
        cp=degrees["cp"],
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        chunks=chunks,
    )
    model = GPT(cfg, par)
    opt = make_optimizer(args, model, 3e-3)
    data = Windows(load_corpus(50_000), cfg.block_size)
    sampler = RandomBatchSampler(len(data), batch, seed=args.seed, num_batches=2)
    loader = dist.shard_dataloader(
        DataLoader(data, batch_sampler=sampler), par.stage_meshes[:1] + par.stage_meshes[-1:], shard_dims="dp"
    )
    m = (args.micro_batches or par.num_stages) if args.schedule is not None else 1
    batches = iter(loader)

    parts = batch_parts(next(batches), m)
    for x, y in parts:  # step 1: gradients and optimizer states, as after any step
        loss = model.loss(x, y)
        (dist.scale(loss, 1.0 / m) if m > 1 else loss).backward()
    opt.step()  # the gradients stay (not cleared): the buffers the view holds all step

    flights = in_flight(args.schedule, par.num_stages, m)
    parts = batch_parts(next(batches), m)
    losses: list[Tensor] = [model.loss(x, y) for x, y in parts[: max(flights.values())]]
    reports = [dist.memory_report(model, opt, loss) for loss in losses]
    lanes = {r: lane for lane, mesh in enumerate(par.stage_meshes) for r in mesh.process_ids}
    rows = []
    for rank in sorted(reports[0].per_rank):
        row = {
            "rank": rank,
            **{c: reports[0].per_rank[rank][c] for c in ("parameters", "gradients", "optimizer_state")},
        }
        row["activations"] = sum(r.per_rank[rank]["activations"] for r in reports[: flights[lanes[rank]]])
        row["in_flight"] = flights[lanes[rank]]
        if rank in reports[0].host:
            row["host"] = dict(reports[0].host[rank])
        rows.append(row)
    if dist.get_rank() == 0:
        with open(args.output, "w") as f:
            json.dump({"instant": "after forward, before backward, step 2", "ranks": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
