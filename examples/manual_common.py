"""Shared by the manual_*.py scripts (seed 003 §2.2.4.1): the primer's data, batches split by
rank, and the loss/accuracy line, every communication written out by the script itself.

Each manual script prints the ``step <n> loss <v> acc1 <a> acc5 <b>`` lines of its
semi-automatic twin (primer_*.py) and of one device.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import numpy as np
from common import log_step
from primer_common import RandomDataset, sizes

import mpipar as dist


def global_batches(args: argparse.Namespace) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The primer's batches (images, labels), whole: every rank reads the same data."""
    input_size, _, batch_size = sizes(args)
    dataset = RandomDataset(args.steps * batch_size, input_size, args.dtype)
    for step in range(args.steps):
        rows = [dataset[i] for i in range(step * batch_size, (step + 1) * batch_size)]
        yield np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def my_rows(batch_size: int, rank: int, world: int) -> slice:
    """This rank's rows of a batch split evenly over ``world`` ranks (data parallelism)."""
    if batch_size % world:
        raise SystemExit(
            f"the global batch {batch_size} does not split evenly over {world} ranks; pass --batch-size "
            f"a multiple of {world}"
        )
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


def metrics(out: dist.Tensor, label: dist.Tensor, loss: dist.Tensor) -> tuple[float, float, float]:
    """(mean loss, top-1, top-5) of these rows."""
    acc1 = dist.nn.functional.accuracy(out, label, k=1)
    acc5 = dist.nn.functional.accuracy(out, label, k=5)
    return float(loss), float(acc1), float(acc5)


def log_averaged(step: int, values: tuple[float, float, float], group: dist.Group | None = None) -> None:
    """All-reduce (average) per-rank loss and accuracies over equal shares of the batch, then log."""
    t = dist.to_tensor(np.array(values, dtype="float64"))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    loss, acc1, acc5 = (float(v) for v in t.numpy())
    log_step(step, loss, acc1=acc1, acc5=acc5)


__all__ = ["global_batches", "log_averaged", "metrics", "my_rows"]
