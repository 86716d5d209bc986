"""A real training state for the checkpoint acceptance tests (simulator and mpiexec).

``trained_state()``: a tiny float64 GPT on ``GPTParallel.from_degrees(2, 2, 2)`` (8 ranks),
AdamW with ZeRO-2 (moments split along dp) and global-norm clipping, dropout (RNG draws), a
data loader, trained two steps; returned as ``training_state(...)``. ``load_into(label, path)``
builds the same model and optimizer under the layout ``TARGETS[label]`` names, restores the
checkpoint into it with ``load_training_state`` and returns its training state again, so the
two can be compared value by value. Used by ``test_checkpoint.py`` and the MPI child script of
``test_checkpoint_mpi.py`` (which puts this directory on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import mpipar as dist
from mpipar.checkpoint import load_training_state, training_state
from mpipar.io import DataLoader, Dataset, RandomBatchSampler
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel

CFG = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1, dtype="float64")
BATCH, STEPS = 4, 2


class Tokens(Dataset):
    """Sample i: tokens i..i+T and the next ones, from a fixed random text."""

    def __init__(self) -> None:
        self.text = np.random.default_rng(11).integers(0, CFG.vocab_size, 200)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.text[i : i + CFG.block_size], self.text[i + 1 : i + CFG.block_size + 1]

    def __len__(self) -> int:
        return len(self.text) - CFG.block_size - 1


def build(par: GPTParallel | None, zero: int) -> tuple[GPT, Any, DataLoader]:
    dist.seed(3)
    model = GPT(CFG, par)
    opt = dist.optimizer.AdamW(
        learning_rate=1e-2,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0),
    )
    if zero:
        opt = dist.shard_optimizer(opt, [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][zero - 1]("dp"))
    loader = DataLoader(Tokens(), batch_sampler=RandomBatchSampler(len(Tokens()), BATCH, seed=5, num_batches=10))
    return model, opt, loader


def trained_state() -> dict[str, Any]:
    """The dp2 x tp2 x pp2 state after two steps (needs a world of 8)."""
    par = GPTParallel.from_degrees(2, 2, 2)
    model, opt, loader = build(par, zero=2)
    batches = iter(dist.shard_dataloader(loader, [par.stage_meshes[0], par.stage_meshes[-1]], shard_dims="dp"))
    for _ in range(STEPS):
        x, y = next(batches)
        model.loss(x, y).backward()
        opt.step()
        opt.clear_grad()
    return training_state(model=model, optimizer=opt, step=STEPS, loader=loader)


TARGETS: dict[str, tuple[int, Callable[[], GPTParallel | None], int]] = {
    # (world size, layout, ZeRO stage)
    "tp4xdp2": (
        8,
        lambda: GPTParallel([dist.ProcessMesh(np.arange(8).reshape(4, 2).T.tolist(), dim_names=["dp", "tp"])]),
        1,
    ),
    "4 ranks": (4, lambda: GPTParallel.from_degrees(1, 4), 0),
    "3 ranks": (3, lambda: GPTParallel.from_degrees(3, 1), 3),  # parameters and moments split 3 ways, unevenly
    "1 rank": (1, lambda: GPTParallel.from_degrees(1, 1), 0),
    "1 rank, dense": (1, lambda: None, 0),
}


def load_into(label: str, path: str) -> tuple[dict[str, Any], Any]:
    """The training state restored under ``TARGETS[label]`` (and its optimizer, to inspect)."""
    _, layout, zero = TARGETS[label]
    model, opt, loader = build(layout(), zero)
    dist.set_rng_state({"seed": 0, "draws": 0})  # restored by the load
    resumed = load_training_state(path, model=model, optimizer=opt, loader=loader)
    return training_state(model=model, optimizer=opt, step=resumed.step, loader=loader), opt
