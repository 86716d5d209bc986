"""What every example shares: ``--steps/--dtype/--tiny`` flags, one log line per step, world checks."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

import mpipar as dist


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


def seeded_uniform(index: int, shape: Sequence[int], dtype: str, salt: int = 0) -> np.ndarray:
    """The seed's ``np.random.uniform`` sample, seeded by its index so every process agrees."""
    return np.random.default_rng([index, salt]).uniform(size=list(shape)).astype(dtype)


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
