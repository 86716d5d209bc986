"""What every example shares: ``--steps/--dtype/--tiny`` flags, one log line per step, world checks;
and what the language-model examples (``gpt.py``, ``llama.py``) share: the corpus, the mesh
flag, the training flags and loop (checkpoints, pipeline schedules, ZeRO, ...), greedy sampling."""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpipar as dist
from mpipar import cliargs
from mpipar.checkpoint import load_training_state, prune_series, resume_target, save_training_state, step_path
from mpipar.io import DataLoader, Dataset, RandomBatchSampler
from mpipar.runtime.hosts import format_map


def parser(description: str, steps: int = 5) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="training steps to run")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="parameter and data dtype")
    p.add_argument("--tiny", action="store_true", help="a configuration small enough for tests")
    return p


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """``--schedule KIND --micro-batches M``: run the step through dist.to_static's pipeline."""
    p.add_argument(
        "--schedule",
        default=None,
        choices=["FThenB", "1F1B", "Interleaved1F1B", "ZBH1"],
        help="pipeline schedule (runs the step through dist.to_static)",
    )
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: one per stage)")
    p.add_argument("--chunks", type=int, default=2, help="virtual stages per rank for Interleaved1F1B")


def pipeline_strategy(args: argparse.Namespace, stages: int) -> dist.Strategy:
    strategy = dist.Strategy()
    strategy.pipeline.enable = True
    strategy.pipeline.schedule_mode = args.schedule
    strategy.pipeline.accumulate_steps = args.micro_batches or stages
    strategy.pipeline.vpp_degree = 1  # virtual stages per mesh are read off the model
    return strategy


def setup(args: argparse.Namespace, seed: int = 2024) -> None:
    """Seed the counter-based generator and set the default dtype (same in every launch mode)."""
    dist.seed(seed)
    dist.nn.set_default_dtype(args.dtype)


def log_step(step: int, loss: float, **metrics: float) -> None:
    """``step <n> loss <value>`` on one rank, full precision so launch modes can be compared."""
    extra = "".join(f" {k} {v:.6f}" for k, v in metrics.items())
    dist.print_once(f"step {step} loss {loss:.15g}{extra}", flush=True)


def step_time_spread(seconds: list[float], warmup: int = 2, window: int = 9) -> str | None:
    """``step time p10 / p50 / p90`` and ``p90 / p50`` of the steps after the first ``warmup``
    (they fill caches), or None with fewer than two such steps.

    Also p90 / p50 of each step's time over the median of the ``window`` steps around it: on
    a shared machine the load drifts over a run (tens of steps slow, then tens fast), which
    widens the plain p90 / p50 without any step being slower than its neighbours; this one
    shows the step-to-step jitter alone."""
    timed = np.asarray(seconds[warmup:], dtype=np.float64) * 1e3
    if timed.size < 2:
        return None
    p10, p50, p90 = np.percentile(timed, [10, 50, 90])
    half = window // 2
    local = [timed[i] / np.median(timed[max(0, i - half) : i + half + 1]) for i in range(timed.size)]
    l50, l90 = np.percentile(local, [50, 90])
    return (
        f"step time over {timed.size} steps after {warmup} warm-up: p10 {p10:.1f} ms, p50 {p50:.1f} ms, "
        f"p90 {p90:.1f} ms, p90/p50 {p90 / p50:.2f} ({l90 / l50:.2f} against the running median of {window} steps)"
    )


def require_world(needed: int, what: str) -> None:
    """Refuse a world too small for the meshes (larger is fine: the extra ranks idle)."""
    backend = dist.current_backend()
    fixed = backend.name in ("mpi", "nccl") or getattr(backend, "_fixed", None) is not None
    if fixed and backend.world_size < needed:
        raise SystemExit(
            f"{what} needs {needed} ranks, but the world has {backend.world_size}; launch with -n {needed}"
        )


class Progress:
    """A progress bar (step, loss, tokens/s) on a terminal; nothing otherwise (log lines only)."""

    def __init__(self, total: int, tokens_per_step: int) -> None:
        self.total, self.tokens = total, tokens_per_step
        self.start = time.perf_counter()
        self.tty = sys.stdout.isatty() and dist.get_rank() == 0

    def update(self, step: int, loss: float, step_seconds: float | None = None) -> None:
        if not self.tty:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        done = int(30 * step / max(1, self.total))
        bar = "#" * done + "-" * (30 - done)
        ms = "" if step_seconds is None else f" {1e3 * step_seconds:.1f} ms/step"
        sys.stdout.write(
            f"\r[{bar}] step {step}/{self.total} loss {loss:.4f}{ms} {self.tokens * step / elapsed:,.0f} tokens/s"
        )
        sys.stdout.flush()

    def clear(self) -> None:
        if self.tty:
            sys.stdout.write("\r" + " " * 100 + "\r")
            sys.stdout.flush()


# ---------------------------------------------------------------------- language-model examples
MESH_AXES = ("dp", "tp", "pp", "cp")


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
    """Sample i: the characters at i..i+T (input) and i+1..i+T+1 (target), in their order (a
    load-balanced context-parallel split reorders them itself: ``ZigzagShard``)."""

    def __init__(self, codes: np.ndarray, block: int) -> None:
        self.codes, self.block = codes, block

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.codes[i : i + self.block], self.codes[i + 1 : i + self.block + 1]

    def __len__(self) -> int:
        return len(self.codes) - self.block - 1


def parse_mesh(text: str) -> dict[str, int]:
    try:
        return cliargs.parse_degrees(text, MESH_AXES, "--mesh")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


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


def add_training_args(p: argparse.ArgumentParser, model: str) -> None:
    """The flags gpt.py and llama.py share (mesh, parallel features, batch, checkpoints, sampling)."""
    p.add_argument(
        "--mesh",
        default=None,
        help="degrees, e.g. dp=2,tp=2,pp=2,cp=2 (their product is the world size; default: data parallel over the whole world)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="split norm/dropout regions along the sequence")
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
        "--layers", type=int, default=None, help=f"{model} blocks (default 4; with --tiny max(2, pp x chunks))"
    )
    add_pipeline_args(p)


def check_training_args(args: argparse.Namespace, model: str) -> None:
    check_checkpoint_flags(args)
    if args.sample < 0:
        raise SystemExit(f"--sample {args.sample}: the number of characters to generate must be >= 0")
    if args.layers is not None and args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: a {model} needs at least one transformer block")


def check_layout(args: argparse.Namespace, degrees: dict[str, int], layers: int, batch: int, chunks: int) -> None:
    """The mesh fits the world, the layers the stages, the batch its micro-batches."""
    backend = dist.current_backend()
    world = math.prod(degrees.values())
    if (
        backend.name in ("mpi", "nccl") or getattr(backend, "_fixed", None) is not None
    ) and backend.world_size != world:
        factors = " * ".join(f"{k}({v})" for k, v in degrees.items())
        raise SystemExit(f"--mesh: {factors} = {world} != world size {backend.world_size}")
    if batch % args.accumulate_steps:
        raise SystemExit(
            f"--batch-size {batch} is not divisible by --accumulate-steps {args.accumulate_steps}: micro-batches must be equal"
        )
    if degrees["pp"] * chunks > layers:
        raise SystemExit(
            f"--mesh pp={degrees['pp']} x {chunks} chunk(s) exceeds the {layers} layers to spread over stages"
        )
    if args.schedule is not None and args.accumulate_steps > 1:
        raise SystemExit("--accumulate-steps and --schedule both cut the batch; with a schedule use --micro-batches")


GRAD_CLIP_NORM = 1.0
"""The global norm ``make_optimizer`` clips gradients to (``--auto`` prices the clipping)."""


def make_optimizer(args: argparse.Namespace, model: Any, lr: float) -> Any:
    """AdamW with weight decay and global-norm clipping, under ``--zero`` over dp and ``--offload``."""
    opt = dist.optimizer.AdamW(
        learning_rate=lr,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=dist.optimizer.ClipGradByGlobalNorm(GRAD_CLIP_NORM),
    )
    if args.zero:
        opt = dist.shard_optimizer(
            opt, [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][args.zero - 1]("dp")
        )
    if args.offload:
        opt = dist.offload_optimizer(opt)
    return opt


def add_attention_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--attention",
        default=default,
        choices=["plain", "fused"],
        help=f"attention as separate ops (plain) or blockwise fused (scaled_dot_product_attention); default {default}",
    )
    p.add_argument(
        "--cp-comm",
        default="allgather",
        choices=["allgather", "ring"],
        help="context parallel: all-gather the keys and values (default) or pass them around the cp ring "
        "(point-to-point; fused attention only)",
    )


def parallel_options(args: argparse.Namespace, cp: int, chunks: int) -> dict[str, Any]:
    """The ``GPTParallel.from_degrees`` options the flags set besides dp, tp and pp. ``--cp-comm
    ring`` passes key/value blocks around fused attention's loop: it needs fused attention."""
    if args.cp_comm == "ring" and args.attention != "fused" and cp > 1:
        raise SystemExit("--cp-comm ring needs --attention fused (plain attention gathers keys and values)")
    return {
        "cp": cp,
        "sequence_parallel": args.sequence_parallel,
        "recompute": args.recompute,
        "chunks": chunks,
        "cp_comm": args.cp_comm,
    }


def run_size(args: argparse.Namespace, degrees: dict[str, int], chunks: int) -> tuple[int, int, int, float]:
    """(layers, batch, corpus characters, learning rate) of --tiny or the default model: the
    batch leaves room for a micro-batch per stage and dp shard under a schedule."""
    if args.tiny:
        layers = args.layers or max(2, degrees["pp"] * chunks)
        batch, chars, lr = args.batch_size or 8, 50_000, args.lr or 3e-3
        if args.schedule is not None and args.batch_size is None:
            batch = max(batch, degrees["dp"] * (args.micro_batches or degrees["pp"] * chunks))
        return layers, batch, chars, lr
    return args.layers or 4, args.batch_size or 16, 2_000_000, args.lr or 3e-3


def train_language_model(
    args: argparse.Namespace,
    model: Any,
    par: Any,
    loss_fn: Callable[..., Any],
    *,
    block: int,
    batch: int,
    chars: int,
    lr: float,
    describe: Callable[[int], str],
) -> None:
    """The training loop gpt.py and llama.py share: AdamW (ZeRO, offload), the stdlib corpus in
    checkpoints (save/resume), pipeline schedules via to_static,
    gradient accumulation, one ``step <n> loss <v>`` line per step, a greedy sample at the end.
    ``describe(chars)`` is the header printed before step 0."""
    micro = batch // args.accumulate_steps
    opt = make_optimizer(args, model, lr)
    codes = load_corpus(chars)
    data = Windows(codes, block)
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
    tokens = batch * block
    dist.print_once(describe(len(codes)), flush=True)
    progress = Progress(args.steps, tokens)
    run_start, first = time.perf_counter(), done
    # With --schedule, dist.to_static runs each step's micro-batches through the pipeline schedule.
    dist_model = (
        None
        if args.schedule is None
        else dist.to_static(model, loader, loss_fn, opt, pipeline_strategy(args, par.num_stages))
    )
    overlap = None if args.overlap is None else dist.overlap_grad_reduction(bucket_mib=args.overlap)
    step_seconds: list[float] = []
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
        step_seconds.append(seconds)
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
    spread = step_time_spread(step_seconds)
    if spread is not None:  # stderr: stdout keeps the loss log as it was
        dist.print_once(spread, file=sys.stderr, flush=True)
    if args.save_final:
        save(args.save_final)
    if args.sample:
        prompt = codes[:block]
        text = generate(model, prompt, args.sample, rows=par.axis_size(par.dp))
        dist.print_once(
            f"sample (greedy, after the first {len(prompt)} characters of the data):\n{decode(prompt)}|{decode(text)}",
            flush=True,
        )


def corpus_line(chars: int) -> str:
    return f"data: {chars:,} characters of the Python standard library's .py files ({sysconfig.get_paths()['stdlib']})"


def header(name: str, params: int, mesh: str, ranks: int, batch: int, accumulate: int, block: int, chars: int) -> str:
    """One block saying what this run trains, where, and on what (printed before step 0)."""
    micro = f" in {accumulate} micro-batches" if accumulate > 1 else ""
    hosts = dist.rank_hosts()  # as `mpipar launch --hosts` placed the ranks
    where = f"\nhosts: {'; '.join(format_map(hosts))}" if hosts is not None and len(set(hosts)) > 1 else ""
    return (
        f"{name}: {params:,} parameters | mesh {mesh} ({ranks} rank{'s' * (ranks != 1)}) | "
        f"batch {batch} x {block} tokens{micro} = {batch * block:,} tokens/step\n{corpus_line(chars)}{where}"
    )


def generate(model: Any, prompt: np.ndarray, count: int, rows: int) -> np.ndarray:
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
