"""What the paddle_auto examples add around a seed's lines: the shared flags, seeding, sizes."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import log_step, parser, require_world, setup


def seed_args(description: str) -> argparse.Namespace:
    """``--steps N`` (one epoch of N batches instead of the seed's 5 x 100), ``--dtype``,
    ``--tiny`` (the 102400-wide hidden layer shrunk to 64); seeds NumPy's global generator, which
    the seed's dataset draws from, and mpipar's."""
    p = parser(description, steps=0)
    args = p.parse_args()
    setup(args)
    np.random.seed(2024)
    return args


def shrink(args: argparse.Namespace, epoch: int, batch_num: int) -> tuple[int, int, int]:
    """(epochs, batches per epoch, hidden size): the seed's, or those the flags ask for."""
    if args.steps:
        epoch, batch_num = 1, args.steps
    return epoch, batch_num, 64 if args.tiny else 102400


__all__ = ["log_step", "require_world", "seed_args", "shrink"]
