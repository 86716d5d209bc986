"""The small graph the tape tests share (tests/unit/test_dispatch_short_path.py,
tests/unit/test_backward_replay.py): ``relu(x @ w + b)`` summed two ways, on a one-rank mesh
of the current backend, with a choice of which of its three leaves want a gradient."""

from __future__ import annotations

import numpy as np

import mpipar as dist
from mpipar.mesh import ProcessMesh


def leaves(needs: tuple[bool, bool, bool]) -> tuple[dist.Tensor, dist.Tensor, dist.Tensor]:
    """``x`` (replicated), ``w`` (columns split) and ``b`` (split): the same values every call;
    ``needs[i]`` says whether leaf ``i`` wants a gradient."""
    rng = np.random.default_rng(3)
    mesh = ProcessMesh([0], dim_names=["mp"])
    x = dist.shard_tensor(rng.standard_normal((3, 4)), mesh, [dist.Replicate()])
    w = dist.shard_tensor(rng.standard_normal((4, 5)), mesh, [dist.Shard(1)])
    b = dist.shard_tensor(rng.standard_normal(5), mesh, [dist.Shard(0)])
    for t, need in zip((x, w, b), needs, strict=True):
        t.stop_gradient = not need
    return x, w, b


def loss(x: dist.Tensor, w: dist.Tensor, b: dist.Tensor) -> dist.Tensor:
    """``h = relu(x @ w + b)``; ``mean(h * h) + sum(0.5 h)``: ``h`` saved three times, and
    resharded by a local step before each reduction."""
    h = dist.nn.functional.relu(dist.add(dist.matmul(x, w), b))
    return dist.add(dist.mean(dist.multiply(h, h)), dist.sum(dist.scale(h, 0.5)))
