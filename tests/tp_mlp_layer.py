"""The small Megatron-style MLP (column- then row-parallel Linear) that the compiled-step tests
(tests/unit/test_replay.py, tests/unit/test_capture.py) train through ``dist.to_static``, its
parameters as plain tensors for the steps written in ops, and what those tests compare."""

from __future__ import annotations

from typing import Any

import numpy as np

import mpipar as dist

F = dist.nn.functional


class MLP(dist.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = dist.nn.Linear(6, 16)
        self.l2 = dist.nn.Linear(16, 6)

    def forward(self, x: dist.Tensor) -> dist.Tensor:
        return self.l2(F.relu(self.l1(x)))


def sharded_mlp(mesh: dist.ProcessMesh, optimizer: type[Any]) -> tuple[MLP, Any]:
    """The MLP with seed 1's weights, split over ``mesh``'s one axis, and ``optimizer`` (lr 0.05) on it."""
    dist.seed(1)
    m = MLP()
    dist.shard_tensor(m.l1.weight, mesh, [dist.Shard(1)])
    dist.shard_tensor(m.l1.bias, mesh, [dist.Shard(0)])
    dist.shard_tensor(m.l2.weight, mesh, [dist.Shard(0)])
    dist.shard_tensor(m.l2.bias, mesh, [dist.Replicate()])
    return m, optimizer(learning_rate=0.05, parameters=m.parameters())


def mse(out: dist.Tensor, y: dist.Tensor) -> dist.Tensor:
    d = dist.subtract(out, y)
    return dist.mean(dist.multiply(d, d))


def mlp_parameters(mesh: dist.ProcessMesh, tp: bool) -> list[dist.Tensor]:
    """``w1, b1, w2, b2`` of the MLP (float64, seed 0) on ``mesh``'s one axis: the hidden dim split
    (``tp``, Megatron's layout) or every parameter replicated (data parallel)."""
    rng = np.random.default_rng(0)
    w1 = dist.shard_tensor(
        dist.Parameter(rng.standard_normal((6, 16))), mesh, [dist.Shard(1) if tp else dist.Replicate()]
    )
    b1 = dist.shard_tensor(dist.Parameter(rng.standard_normal(16)), mesh, [dist.Shard(0) if tp else dist.Replicate()])
    w2 = dist.shard_tensor(
        dist.Parameter(rng.standard_normal((16, 6))), mesh, [dist.Shard(0) if tp else dist.Replicate()]
    )
    b2 = dist.shard_tensor(dist.Parameter(rng.standard_normal(6)), mesh, [dist.Replicate()])
    return [w1, b1, w2, b2]


def mlp_loss(x: dist.Tensor, w1: dist.Tensor, b1: dist.Tensor, w2: dist.Tensor, b2: dist.Tensor) -> dist.Tensor:
    """The MLP on ``x`` with these parameters (``mlp_parameters``), and the mean square of its output."""
    h = F.relu(dist.add(dist.matmul(x, w1), b1))
    z = dist.add(dist.matmul(h, w2), b2)
    return dist.mean(dist.multiply(z, z))


def comm_events(comm: dist.CommDebugMode) -> list[tuple[Any, ...]]:
    """Every recorded communication, as a comparable tuple."""
    return [(e.op, e.ranks, e.input_nbytes, e.output_nbytes, e.dtype, e.reduce_type) for e in comm.events]
