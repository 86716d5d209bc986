"""Seed 003's running example, shared by the primer_*.py scripts: SimpleNet, data, Momentum, loop.

Each primer script only adds its parallel strategy, as the primer does (§2.2.4.2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
from common import log_step, parser, setup

import mpipar as dist
from mpipar.io import BatchSampler, DataLoader, Dataset

base_lr = 0.1  # learning rate
momentum_rate = 0.9
l2_decay = 1e-4
class_dim = 10


def primer_args(description: str) -> argparse.Namespace:
    p = parser(description, steps=10)
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default 32, or 8 with --tiny)")
    return p


def sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """(input, inner, batch): the primer's 256 / 102400 / 32, or a tiny version."""
    return (16, 32, args.batch_size or 8) if args.tiny else (256, 102400, args.batch_size or 32)


class RandomDataset(Dataset):
    """The primer's random data, seeded per sample so every process sees the same."""

    def __init__(self, num_samples: int, input_size: int, dtype: str) -> None:
        self.num_samples, self.input_size, self.dtype = num_samples, input_size, dtype

    def __getitem__(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([idx, 3])
        image = rng.random([self.input_size]).astype(self.dtype)
        label = rng.integers(0, class_dim - 1, (1,)).astype("int64")
        return image, label

    def __len__(self) -> int:
        return self.num_samples


def optimizer_setting(parameter_list: list[dist.Tensor]) -> dist.optimizer.Optimizer:
    return dist.optimizer.Momentum(
        learning_rate=base_lr,
        momentum=momentum_rate,
        weight_decay=dist.regularizer.L2Decay(l2_decay),
        parameters=parameter_list,
    )


class SimpleNet(dist.nn.Layer):
    def __init__(self, input_size: int, inner_size: int, output_size: int) -> None:
        super().__init__()
        self.linear1 = dist.nn.Linear(input_size, inner_size)
        self.linear2 = dist.nn.Linear(inner_size, input_size)
        self.linear3 = dist.nn.Linear(input_size, output_size)
        self.relu = dist.nn.ReLU()

    def forward(self, x: dist.Tensor) -> dist.Tensor:
        x = self.linear1(x)
        x = self.linear2(x)
        x = self.linear3(x)
        x = self.relu(x)
        return x


def train(
    args: argparse.Namespace,
    model: dist.nn.Layer,
    optimizer: dist.optimizer.Optimizer | None = None,
    place_batch: Callable[[dist.Tensor, dist.Tensor], tuple[dist.Tensor, dist.Tensor]] | None = None,
) -> None:
    """The primer's training loop; one ``step <n> loss <v> acc1 <a> acc5 <b>`` line per batch."""
    input_size, _, batch_size = sizes(args)
    optimizer = optimizer or optimizer_setting(model.parameters())
    loss_func = dist.nn.CrossEntropyLoss()
    dataset = RandomDataset(args.steps * batch_size, input_size, args.dtype)
    sampler = BatchSampler(dataset, batch_size=batch_size, shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_sampler=sampler)
    model.train()
    for batch_id, (img, label) in enumerate(loader()):
        label.stop_gradient = True
        if place_batch is not None:
            img, label = place_batch(img, label)
        out = model(img)
        loss = loss_func(out, label)
        avg_loss = dist.mean(loss)
        acc_top1 = dist.metric.accuracy(input=out, label=label, k=1)
        acc_top5 = dist.metric.accuracy(input=out, label=label, k=5)
        avg_loss.backward()
        optimizer.step()
        model.clear_gradients()
        log_step(batch_id, float(avg_loss), acc1=float(acc_top1), acc5=float(acc_top5))


__all__ = ["SimpleNet", "optimizer_setting", "primer_args", "setup", "sizes", "train"]
