"""A small character-level GPT trained on the Python standard library's own source files.

    python examples/gpt.py                                  # every rank in-process (simulator)
    python -m simulator -n 8 examples/gpt.py --mesh dp=2,tp=2,pp=2 --sequence-parallel
    python -m simulator --reference examples/gpt.py --tiny  # one big device
    mpiexec -n 8 python examples/gpt.py --mesh dp=2,tp=4 --zero 2 --recompute selective
    python examples/gpt.py --tiny --steps 6 --save-every 3 --save-dir ck   # ck/step-3, ck/step-6
    python -m simulator -n 4 examples/gpt.py --tiny --steps 6 --mesh dp=4 --resume ck/step-3
    python -m simulator -n 4 examples/gpt.py --tiny --auto  # the search picks mesh, schedule, ...

The mesh is dp x tp per pipeline stage, pp stages (naive pipeline by reshard across stage
meshes); see mpipar/models/gpt.py for the layout. The text is the .py files of the running
interpreter's standard library, read in sorted order (characters outside ASCII become '?').

Checkpoints (``--save-every N --save-dir DIR``) hold the model, the optimizer's states (in
their ZeRO layout), the step, the RNG state and the data position; ``--resume`` takes one
(or DIR: its latest complete step-<k>) on any mesh and continues with the next step, printing
the same ``step <n> loss <v>`` lines as a run that was never interrupted (see the README).
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time

import numpy as np
from common import Progress, add_pipeline_args, log_step, parser, pipeline_strategy, setup

import mpipar as dist
from mpipar import cliargs
from mpipar.checkpoint import load_training_state, prune_series, resume_target, save_training_state, step_path
from mpipar.io import DataLoader, Dataset, RandomBatchSampler
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel, gpt_loss
from mpipar.runtime.hosts import format_map
from simulator.auto import choose, resolve_profile
from simulator.search import Candidate
from simulator.step_trace import GPTShape


def load_corpus(max_chars: int) -> np.ndarray:
    """Character codes (0..127) of the stdlib's .py files, sorted by path, up to ``max_chars``."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_chars:
                break
        if total >= max_chars:
            break
    if not chunks:
        raise SystemExit(f"no Python sources found under {root}")
    text = np.frombuffer(b"".join(chunks)[:max_chars], dtype=np.uint8).astype(np.int64)
    return np.where(text < 128, text, ord("?"))


class Windows(Dataset):
    """Sample i: the characters at i..i+T (input) and i+1..i+T+1 (target)."""

    def __init__(self, codes: np.ndarray, block: int) -> None:
        self.codes, self.block = codes, block

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.codes[i : i + self.block], self.codes[i + 1 : i + self.block + 1]

    def __len__(self) -> int:
        return len(self.codes) - self.block - 1


def parse_mesh(text: str) -> dict[str, int]:
    try:
        return cliargs.parse_degrees(text, ("dp", "tp", "pp"), "--mesh")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=200)
    p.add_argument(
        "--mesh",
        default=None,
        help="degrees, e.g. dp=2,tp=2,pp=2 (their product is the world size; default: data parallel over the whole world)",
    )
    p.add_argument(
        "--sequence-parallel", action="store_true", help="split LayerNorm/Dropout regions along the sequence"
    )
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the dp axis")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--offload", action="store_true", help="keep the optimizer's states in host memory between steps")
    p.add_argument(
        "--overlap",
        type=cliargs.finite_float(0.0, what="MiB per bucket"),
        default=None,
        metavar="MIB",
        help="reduce data-parallel gradients in buckets of MIB MiB while backward runs (dist.overlap_grad_reduction)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 16, or 8 with --tiny)")
    p.add_argument("--accumulate-steps", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--memory", action="store_true", help="print each rank's memory by category after step 0")
    p.add_argument(
        "--save-every", type=int, default=0, metavar="N", help="save a checkpoint every N steps to --save-dir/step-<k>"
    )
    p.add_argument("--save-dir", default=None, help="where --save-every puts its checkpoints (step-<k>: k steps done)")
    p.add_argument(
        "--keep-last", type=int, default=0, metavar="K", help="keep only the newest K checkpoints in --save-dir"
    )
    p.add_argument(
        "--resume", default=None, metavar="PATH", help="continue from a checkpoint (or a --save-dir's latest one)"
    )
    p.add_argument(
        "--save-final", default=None, metavar="PATH", help="save the final state (weights, optimizer, ...) there"
    )
    p.add_argument(
        "--sample", type=int, default=48, metavar="N", help="characters the trained model writes at the end (0: none)"
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="transformer blocks (default 4; with --tiny max(2, pp x chunks), or 4 with --auto)",
    )
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
    add_pipeline_args(p)
    args = p.parse_args()
    check_checkpoint_flags(args)
    if args.sample < 0:
        raise SystemExit(f"--sample {args.sample}: the number of characters to generate must be >= 0")
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: a GPT needs at least one transformer block")
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
    if args.tiny:
        layers = args.layers or max(2, degrees["pp"] * chunks)
        cfg = GPTConfig(
            vocab_size=128, block_size=16, n_layer=layers, n_head=2, n_embd=16, dropout=0.1, dtype=args.dtype
        )
        batch, chars, lr = args.batch_size or 8, 50_000, args.lr or 3e-3
        if args.schedule is not None and args.batch_size is None:  # room for a micro-batch per stage and dp shard
            batch = max(batch, degrees["dp"] * (args.micro_batches or degrees["pp"] * chunks))
    else:
        cfg = GPTConfig(
            vocab_size=128, block_size=64, n_layer=args.layers or 4, n_head=4, n_embd=128, dropout=0.0, dtype=args.dtype
        )
        batch, chars, lr = args.batch_size or 16, 2_000_000, args.lr or 3e-3
    dp, tp, pp = degrees["dp"], degrees["tp"], degrees["pp"]
    backend = dist.current_backend()
    world = dp * tp * pp
    if (
        backend.name in ("mpi", "nccl") or getattr(backend, "_fixed", None) is not None
    ) and backend.world_size != world:
        raise SystemExit(f"--mesh: dp({dp}) * tp({tp}) * pp({pp}) = {world} != world size {backend.world_size}")
    if batch % args.accumulate_steps:
        raise SystemExit(
            f"--batch-size {batch} is not divisible by --accumulate-steps {args.accumulate_steps}: micro-batches must be equal"
        )
    if pp * chunks > cfg.n_layer:
        raise SystemExit(f"--mesh pp={pp} x {chunks} chunk(s) exceeds the {cfg.n_layer} layers to spread over stages")
    if args.schedule is not None and args.accumulate_steps > 1:
        raise SystemExit("--accumulate-steps and --schedule both cut the batch; with a schedule use --micro-batches")
    micro = batch // args.accumulate_steps

    par = GPTParallel.from_degrees(
        dp, tp, pp, sequence_parallel=args.sequence_parallel, recompute=args.recompute, chunks=chunks
    )
    model = GPT(cfg, par)
    opt = dist.optimizer.AdamW(
        learning_rate=lr,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0),
    )
    if args.zero:
        opt = dist.shard_optimizer(
            opt, [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][args.zero - 1]("dp")
        )
    if args.offload:
        opt = dist.offload_optimizer(opt)

    codes = load_corpus(chars)
    data = Windows(codes, cfg.block_size)
    sampler = RandomBatchSampler(len(data), micro, seed=args.seed, num_batches=args.steps * args.accumulate_steps)
    loader = dist.shard_dataloader(
        DataLoader(data, batch_sampler=sampler), par.stage_meshes[:1] + par.stage_meshes[-1:], shard_dims="dp"
    )
    config = {
        "seed": args.seed,
        "tiny": args.tiny,
        "dtype": args.dtype,
        "batch_size": batch,
        "accumulate_steps": args.accumulate_steps,
        "lr": lr,
        "mesh": args.mesh,
        "zero": args.zero,
    }
    done = 0  # steps completed
    # --resume, or under `mpipar launch --max-restarts` the latest checkpoint of a restart
    resume = resume_target(args.resume, args.save_dir)
    if resume:
        resumed = load_training_state(resume, model=model, optimizer=opt, loader=loader)
        done = resumed.step
        note_resume(resumed.path, done, resumed.extra if isinstance(resumed.extra, dict) else {}, config)
        if done >= args.steps:
            dist.print_once(f"note: --steps {args.steps}: no step left to run after step {done - 1}", file=sys.stderr)

    def save(path: str) -> None:
        save_training_state(path, model=model, optimizer=opt, step=done, loader=loader, extra=config)

    batches = iter(loader)
    tokens = batch * cfg.block_size
    dist.print_once(
        header(model, args.mesh, dp * tp * pp, batch, args.accumulate_steps, cfg.block_size, len(codes)), flush=True
    )
    progress = Progress(args.steps, tokens)
    run_start, first = time.perf_counter(), done
    # With --schedule, dist.to_static runs each step's micro-batches through the pipeline schedule.
    dist_model = (
        None
        if args.schedule is None
        else dist.to_static(model, loader, gpt_loss, opt, pipeline_strategy(args, par.num_stages))
    )
    overlap = None if args.overlap is None else dist.overlap_grad_reduction(bucket_mib=args.overlap)
    for step in range(done, args.steps):
        step_start = time.perf_counter()
        total = 0.0
        if dist_model is not None:
            x, y = next(batches)
            total = float(dist_model(x, y))
        for _ in range(args.accumulate_steps if dist_model is None else 0):
            x, y = next(batches)
            loss = model.loss(x, y)
            if args.memory and step == 0:
                dist.print_once(dist.memory_report(model, opt, loss).table())
            if args.accumulate_steps > 1:
                loss = dist.scale(loss, 1.0 / args.accumulate_steps)
            if overlap is not None:
                with overlap:  # data-parallel gradient reductions start while backward runs
                    loss.backward()
            else:
                loss.backward()
            total += float(loss)
        if dist_model is None:
            opt.step()
            opt.clear_grad()
        seconds = time.perf_counter() - step_start
        if step % args.log_every == 0 or step == args.steps - 1:
            progress.clear()
            log_step(step, total)
            if not progress.tty:  # stdout keeps the parseable loss log; the bar shows speed on a terminal
                dist.print_once(
                    f"step {step}: {1e3 * seconds:.1f} ms/step, {tokens / max(seconds, 1e-9):,.0f} tokens/s",
                    file=sys.stderr,
                    flush=True,
                )
        progress.update(step + 1, total, seconds)
        dist.mark_step(step)  # the launcher's heartbeat: this rank is alive and past this step
        done = step + 1
        if args.save_every and done % args.save_every == 0:
            save(step_path(args.save_dir, done))
            if args.keep_last:
                prune_series(args.save_dir, args.keep_last)
    progress.clear()
    ran = max(0, args.steps - first)
    elapsed = time.perf_counter() - run_start
    if ran:
        dist.print_once(
            f"trained {ran} step{'s' * (ran != 1)} in {elapsed:.1f} s: {1e3 * elapsed / ran:.1f} ms/step, "
            f"{tokens * ran / max(elapsed, 1e-9):,.0f} tokens/s",
            flush=True,
        )
    if args.save_final:
        save(args.save_final)
    if args.sample:
        prompt = codes[: cfg.block_size]
        text = generate(model, prompt, args.sample, rows=dp)
        dist.print_once(
            f"sample (greedy, after the first {len(prompt)} characters of the data):\n{decode(prompt)}|{decode(text)}",
            flush=True,
        )


def fixed_world() -> int | None:
    """The world size a launcher fixed (mpiexec -n, simulator -n), else None (the simulator grows its world)."""
    backend = dist.current_backend()
    fixed = backend.name in ("mpi", "nccl") or (
        getattr(backend, "_fixed", None) is not None and not getattr(backend, "reference", False)
    )
    return backend.world_size if fixed else None


def default_mesh() -> str:
    """Data parallel over the whole world when a launcher fixed its size (mpiexec -n, simulator -n); else one rank."""
    return f"dp={fixed_world() or 1}"


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
        result = choose(shape, world or 1, batch, resolved.profile, limit_bytes=args.memory_limit)
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


def header(model: GPT, mesh: str, ranks: int, batch: int, accumulate: int, block: int, chars: int) -> str:
    """One block saying what this run trains, where, and on what (printed before step 0)."""
    micro = f" in {accumulate} micro-batches" if accumulate > 1 else ""
    hosts = dist.rank_hosts()  # as `mpipar launch --hosts` placed the ranks
    where = f"\nhosts: {'; '.join(format_map(hosts))}" if hosts is not None and len(set(hosts)) > 1 else ""
    return (
        f"GPT: {model.num_parameters():,} parameters | mesh {mesh} ({ranks} rank{'s' * (ranks != 1)}) | "
        f"batch {batch} x {block} tokens{micro} = {batch * block:,} tokens/step\n"
        f"data: {chars:,} characters of the Python standard library's .py files ({sysconfig.get_paths()['stdlib']})"
        f"{where}"
    )


def generate(model: GPT, prompt: np.ndarray, count: int, rows: int) -> np.ndarray:
    """Greedy decoding of ``count`` characters after ``prompt`` (a full block, so every layout's split divides).

    The batch repeats the window ``rows`` (= dp) times so the data-parallel split has a row per shard;
    row 0's last position gives the next character, the same on every rank.
    """
    window, out = prompt.copy(), []
    model.eval()
    with dist.no_grad():
        for _ in range(count):
            logits = model(dist.Tensor(np.repeat(window[None, :], rows, axis=0)))
            nxt = int(np.argmax(logits.numpy()[0, -1]))
            out.append(nxt)
            window = np.append(window[1:], nxt)
    model.train()
    return np.array(out, dtype=np.int64)


def decode(codes: np.ndarray) -> str:
    """Characters of the codes, with control characters (newlines too) shown as escapes, on one line."""
    return "".join(chr(c) if 32 <= c < 127 else repr(chr(c))[1:-1] for c in codes.tolist())


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    if args.save_every < 0 or args.keep_last < 0:
        raise SystemExit(f"--save-every ({args.save_every}) and --keep-last ({args.keep_last}) must be >= 0")
    if args.save_every and not args.save_dir:
        raise SystemExit("--save-every needs --save-dir DIR (checkpoints go to DIR/step-<k>)")
    if (args.save_dir or args.keep_last) and not args.save_every:
        raise SystemExit("--save-dir and --keep-last take effect with --save-every N")


def note_resume(path: str, step: int, saved: dict[str, object], now: dict[str, object]) -> None:
    """Say where the run resumes (on stderr: stdout stays the log of an uninterrupted run)."""
    dist.print_once(
        f"resumed from {path}: {step} steps done (saved under --mesh {saved.get('mesh')} --zero {saved.get('zero')})",
        file=sys.stderr,
    )
    for key in ("seed", "tiny", "dtype", "batch_size", "accumulate_steps", "lr"):
        if saved.get(key) != now[key]:
            dist.print_once(
                f"note: {key} is {now[key]!r} now, {saved.get(key)!r} when the checkpoint was saved: "
                "the run will not match an uninterrupted one",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
