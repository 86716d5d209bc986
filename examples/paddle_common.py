"""What the seed-spelled examples (``paddle_auto/``, ``paddle_manual/``) add around a seed's
lines: the shared flags, seeding, the sizes the flags shrink, and the ``step <n> loss <v>`` line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

import numpy as np
from common import add_pipeline_args, log_step, parser, pipeline_strategy, require_world, setup

import mpipar as dist


def seed_args(description: str, pipeline: bool = False) -> argparse.Namespace:
    """``--steps N`` (one epoch of N batches instead of the seed's 5 x 100), ``--dtype``,
    ``--tiny`` (the 102400-wide hidden layer shrunk to 64); seeds NumPy's global generator, which
    the seed's dataset draws from, and mpipar's. ``pipeline``: also ``--schedule`` and
    ``--micro-batches`` (see ``run_scheduled``)."""
    p = parser(description, steps=0)
    if pipeline:
        add_pipeline_args(p)
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


def run_scheduled(
    args: argparse.Namespace,
    model: dist.nn.Layer,
    dataset: dist.io.Dataset,
    loss: Callable[..., dist.Tensor],
    optimizer: dist.optimizer.Optimizer,
    stages: int = 2,
    meshes: list[dist.ProcessMesh] | None = None,
    shard_dims: str | None = None,
    dp: int = 1,
) -> NoReturn:
    """The seed's model, loss and optimizer through ``dist.to_static`` with the pipeline
    ``--schedule`` (seed 000 §4.5's and seed 003 §2.2.4.3.4's static training, with a schedule):
    a batch of a row per micro-batch on each of ``dp`` data-parallel shards (``meshes`` and
    ``shard_dims`` as the seed's ``dist.shard_dataloader`` takes them), one ``step <n> loss <v>``
    line per step; then the program ends (the seed's eager loop does not run)."""
    micro_batches = args.micro_batches or stages
    loader = dist.io.DataLoader(dataset, batch_sampler=dist.io.BatchSampler(dataset, batch_size=dp * micro_batches))
    if meshes is not None:
        loader = dist.shard_dataloader(loader, meshes=meshes, shard_dims=shard_dims)
    dist_model = dist.to_static(model, loader, loss, optimizer, pipeline_strategy(args, stages))
    dist_model.train()
    for step, inputs in enumerate(loader()):
        log_step(step, float(dist_model(inputs)))
        if args.steps and step + 1 >= args.steps:
            break
    raise SystemExit(0)


class StepLog:
    """``step <n> loss <v>`` (rank 0) for each training step, numbered across epochs. A step
    whose loss this rank does not hold (``None``: a pipeline's earlier stage) still counts."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self, loss: object) -> None:
        if loss is not None:
            log_step(self.step, float(loss))  # type: ignore[arg-type]
        self.step += 1


__all__ = ["StepLog", "log_step", "require_world", "run_scheduled", "seed_args", "shrink"]
