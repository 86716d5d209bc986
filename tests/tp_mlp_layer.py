"""The small Megatron-style MLP (column- then row-parallel Linear) that the compiled-step tests
(tests/unit/test_replay.py, tests/unit/test_capture.py) train through ``dist.to_static``."""

from __future__ import annotations

from typing import Any

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
