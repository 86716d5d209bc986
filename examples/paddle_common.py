"""What the seed-spelled examples (``paddle_auto/``, ``paddle_manual/``) add around a seed's
lines: the shared flags, seeding, the sizes the flags shrink, and the ``step <n> loss <v>`` line."""

from __future__ import annotations

import argparse

import numpy as np
from common import log_step, parser, require_world, setup

import mpipar as dist


def seed_args(description: str) -> argparse.Namespace:
    """``--steps N`` (one epoch of N batches instead of the seed's 5 x 100), ``--dtype``,
    ``--tiny`` (the 102400-wide hidden layer shrunk to 64); seeds NumPy's global generator, which
    the seed's dataset draws from, and mpipar's."""
    p = parser(description, steps=0)
    args = p.parse_args()
    setup(args)
    np.random.seed(2024)
    return args


def shrink(args: argparse.Namespace, epoch: int, batch_num: int, split: bool = False) -> tuple[int, int, int]:
    """(epochs, batches per epoch, hidden size): the seed's, or those the flags ask for.

    ``split``: the seed's sampler deals the dataset's batches out over the ranks (fleet's
    ``DistributedBatchSampler``), so ``--steps N`` makes ``N`` batches per rank."""
    if args.steps:
        epoch, batch_num = 1, args.steps * (dist.get_world_size() if split else 1)
    return epoch, batch_num, 64 if args.tiny else 102400


class StepLog:
    """``step <n> loss <v>`` (rank 0) for each training step, numbered across epochs. A step
    whose loss this rank does not hold (``None``: a pipeline's earlier stage) still counts."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, loss: object) -> None:
        if loss is not None:
            log_step(self.step, float(loss))  # type: ignore[arg-type]
        self.step += 1


__all__ = ["StepLog", "log_step", "require_world", "seed_args", "shrink"]
