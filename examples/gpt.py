"""A small character-level GPT trained on the Python standard library's own source files.

    python examples/gpt.py                                  # every rank in-process (simulator)
    python -m simulator -n 8 examples/gpt.py --mesh dp=2,tp=2,pp=2 --sequence-parallel
    python -m simulator --reference examples/gpt.py --tiny  # one big device
    mpiexec -n 8 python examples/gpt.py --mesh dp=2,tp=4 --zero 2 --recompute selective
    python examples/gpt.py --tiny --steps 6 --save-every 3 --save-dir ck   # ck/step-3, ck/step-6
    python -m simulator -n 4 examples/gpt.py --tiny --steps 6 --mesh dp=4 --resume ck/step-3
    python -m simulator -n 4 examples/gpt.py --tiny --auto  # the search picks mesh, schedule, ...
    python -m simulator -n 4 examples/gpt.py --tiny --mesh cp=2,tp=2 --attention fused  # context parallel

The mesh is dp x cp x tp per pipeline stage, pp stages (naive pipeline by reshard across stage
meshes); cp splits the sequence (context parallel); see mpipar/models/gpt.py for the layout. The text is the .py files of the running
interpreter's standard library, read in sorted order (characters outside ASCII become '?').

Checkpoints (``--save-every N --save-dir DIR``) hold the model, the optimizer's states (in
their ZeRO layout), the step, the RNG state and the data position; ``--resume`` takes one
(or DIR: its latest complete step-<k>) on any mesh and continues with the next step, printing
the same ``step <n> loss <v>`` lines as a run that was never interrupted (see the README).
"""

from __future__ import annotations

import argparse
import sys

from common import (
    GRAD_CLIP_NORM,
    add_attention_arg,
    add_training_args,
    check_layout,
    check_training_args,
    default_mesh,
    fixed_world,
    header,
    parallel_options,
    parse_mesh,
    parser,
    run_size,
    setup,
    train_language_model,
)

import mpipar as dist
from mpipar import cliargs
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel, gpt_loss
from simulator.auto import choose, resolve_profile
from simulator.search import Candidate
from simulator.step_trace import GPTShape


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=200)
    add_training_args(p, "GPT")
    add_attention_arg(p, "plain")
    p.add_argument(
        "--auto",
        action="store_true",
        help="let the strategy search choose --mesh, --schedule, --micro-batches, --zero, ... for this world",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="with --auto: the hardware profile to price on (default: this machine's cached calibration)",
    )
    p.add_argument(
        "--memory-limit",
        type=cliargs.positive_int,
        default=None,
        metavar="BYTES",
        help="with --auto: bytes per rank a strategy may use (default: the profile's device memory, "
        "or this host's memory over the ranks)",
    )
    args = p.parse_args()
    check_training_args(args, "GPT")
    if args.profile is not None and not args.auto:
        raise SystemExit(f"--profile {args.profile}: only --auto prices strategies on a profile; add --auto")
    if args.memory_limit is not None and not args.auto:
        raise SystemExit(f"--memory-limit {args.memory_limit}: only --auto searches within a memory limit; add --auto")
    if args.auto:  # before seeding: the search's traces build models, which would advance the generator
        auto_configure(args)
    setup(args, seed=args.seed)
    args.mesh = args.mesh or default_mesh()
    degrees = parse_mesh(args.mesh)
    chunks = args.chunks if args.schedule == "Interleaved1F1B" else 1
    layers, batch, chars, lr = run_size(args, degrees, chunks)
    block, heads, width, dropout = (16, 2, 16, 0.1) if args.tiny else (64, 4, 128, 0.0)
    cfg = GPTConfig(
        vocab_size=128,
        block_size=block,
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        dropout=dropout,
        dtype=args.dtype,
        attention=args.attention,
    )
    dp, tp, pp, cp = degrees["dp"], degrees["tp"], degrees["pp"], degrees["cp"]
    check_layout(args, degrees, cfg.n_layer, batch, chunks)
    par = GPTParallel.from_degrees(dp, tp, pp, **parallel_options(args, cp, chunks))
    model = GPT(cfg, par)
    train_language_model(
        args,
        model,
        par,
        gpt_loss,
        block=cfg.block_size,
        batch=batch,
        chars=chars,
        lr=lr,
        describe=lambda n: header(
            "GPT", model.num_parameters(), args.mesh, dp * tp * pp * cp, batch, args.accumulate_steps, cfg.block_size, n
        ),
    )


AUTO_EXCLUSIVE = (
    ("--mesh", "mesh", None),
    ("--schedule", "schedule", None),
    ("--micro-batches", "micro_batches", None),
    ("--accumulate-steps", "accumulate_steps", 1),
    ("--zero", "zero", 0),
    ("--recompute", "recompute", "none"),
    ("--sequence-parallel", "sequence_parallel", False),
)
"""Flags --auto sets itself (flag, attribute, default): giving one too is an error naming both."""


def auto_configure(args: argparse.Namespace) -> None:
    """``--auto``: search this world's strategies for this model and batch, then set the flags of the
    fastest as if they had been given. Under mpiexec rank 0 searches and broadcasts its choice, so
    every rank trains the same layout (and no rank waits on a calibration of its own)."""
    for flag, attr, default in AUTO_EXCLUSIVE:
        if getattr(args, attr) != default:
            value = "" if isinstance(default, bool) else f" {getattr(args, attr)}"
            raise SystemExit(f"--auto and {flag}{value}: --auto chooses {flag} itself; give one or the other")
    backend = dist.current_backend()
    if backend.name in ("mpi", "nccl"):
        from mpi4py import MPI  # the launcher's world; imported here so the simulator needs no MPI

        outcome = auto_search(args) if MPI.COMM_WORLD.rank == 0 else None
        outcome = MPI.COMM_WORLD.bcast(outcome, root=0)
    else:
        outcome = auto_search(args)
    if isinstance(outcome, str):  # rank 0's error, raised on every rank so none waits for the others
        raise SystemExit(outcome)
    for key, value in outcome.items():
        setattr(args, key, value)


def auto_search(args: argparse.Namespace) -> dict[str, object] | str:
    """Rank 0's part of --auto: the profile, the search, the report; the chosen flags (or an error)."""
    world = fixed_world()
    batch = args.batch_size or (8 if args.tiny else 16)
    layers = args.layers or 4
    # The GPTConfig main() builds: (hidden, heads, block, dropout) of --tiny and of the default model.
    shape = GPTShape(layers, 16, 2, 16, 128, 1, 0.1) if args.tiny else GPTShape(layers, 128, 4, 64, 128, 1, 0.0)

    def say(line: str) -> None:
        dist.print_once(line, file=sys.stderr, flush=True)

    try:
        resolved = resolve_profile(args.profile, world or 1, can_calibrate=world is not None, say=say)
        result = choose(
            shape, world or 1, batch, resolved.profile, limit_bytes=args.memory_limit, grad_clip=GRAD_CLIP_NORM
        )
    except ValueError as exc:
        return f"--auto: {exc}"
    if not result.ranked:
        return f"--auto: no strategy for {world or 1} rank(s), batch {batch}, {layers} layers: {result.advice() or 'none divides'}"
    dist.print_once(
        f"auto: profile {resolved.profile.name} from {resolved.source}; {result.enumerated} strategies for "
        f"{world or 1} rank(s), batch {batch}, {layers} layers, {result.priced} priced in {result.seconds:.1f} s; "
        f"memory limit {result.memory_limit:,} bytes per rank",
        flush=True,
    )
    chosen = auto_flags(result.ranked[0], layers, batch)
    dist.print_once(
        f"auto: chose     {flag_text(chosen)}  (predicted step {1e3 * result.ranked[0].step_time_s:.3f} ms)", flush=True
    )
    if len(result.ranked) > 1:
        dist.print_once(
            f"auto: runner-up {flag_text(auto_flags(result.ranked[1], layers, batch))}  "
            f"(predicted step {1e3 * result.ranked[1].step_time_s:.3f} ms)",
            flush=True,
        )
    else:
        dist.print_once("auto: no runner-up (one strategy divides and fits)", flush=True)
    return chosen


def auto_flags(c: Candidate, layers: int, batch: int) -> dict[str, object]:
    """The example's flags (argparse attributes) of a searched strategy. One pipeline stage runs its
    micro-batches as gradient accumulation (the search prices pp=1 as a 1F1B of one stage)."""
    st = c.strategy
    staged = st.pp > 1
    return {
        "mesh": f"dp={st.dp},tp={st.tp},pp={st.pp}",
        "schedule": st.schedule if staged else None,
        "micro_batches": st.micro_batches if staged else None,
        "chunks": st.chunks if st.chunks > 1 else 2,
        "accumulate_steps": 1 if staged else st.micro_batches,
        "sequence_parallel": st.sequence_parallel,
        "zero": st.zero,
        "recompute": st.recompute,
        "layers": layers,
        "batch_size": batch,
    }


def flag_text(flags: dict[str, object]) -> str:
    """The command-line spelling of ``auto_flags`` (what to pass to reproduce the run without --auto)."""
    out = [f"--mesh {flags['mesh']}"]
    if flags["schedule"] is not None:
        out.append(f"--schedule {flags['schedule']} --micro-batches {flags['micro_batches']}")
        if flags["schedule"] == "Interleaved1F1B":
            out.append(f"--chunks {flags['chunks']}")
    if flags["accumulate_steps"] != 1:
        out.append(f"--accumulate-steps {flags['accumulate_steps']}")
    if flags["sequence_parallel"]:
        out.append("--sequence-parallel")
    if flags["zero"]:
        out.append(f"--zero {flags['zero']}")
    if flags["recompute"] != "none":
        out.append(f"--recompute {flags['recompute']}")
    out.append(f"--layers {flags['layers']} --batch-size {flags['batch_size']}")
    return " ".join(out)


if __name__ == "__main__":
    main()
