"""Autograd semantics: accumulation across backward calls, stop_gradient and no_grad, in-place marking."""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist


def test_gradient_accumulates_across_backward_calls_and_respects_stop_gradient() -> None:
    mesh = dist.ProcessMesh([0, 1])
    w = dist.shard_tensor(dist.Parameter(np.array([1.0, 2.0, 3.0])), mesh, [dist.Shard(0)])
    frozen = dist.shard_tensor(np.array([4.0, 5.0, 6.0]), mesh, [dist.Replicate()])
    for _ in range(2):
        dist.sum(dist.multiply(w, frozen)).backward()
    np.testing.assert_array_equal(w.grad.full_tensor(), [8.0, 10.0, 12.0])
    assert frozen.grad is None
    w.clear_grad()
    with dist.no_grad():
        y = dist.multiply(w, 2.0)
    assert y.stop_gradient
    with pytest.raises(ValueError, match="does not require grad"):
        dist.sum(y).backward()


def test_in_place_mark_of_an_activation_stays_on_the_tape() -> None:
    mesh = dist.ProcessMesh([0, 1])
    w = dist.Parameter(np.arange(6.0).reshape(2, 3))
    h = dist.multiply(w, 3.0)  # dense, with history
    dist.shard_tensor(h, mesh, [dist.Shard(1)])
    dist.sum(h).backward()
    np.testing.assert_array_equal(w.grad.full_tensor(), np.full((2, 3), 3.0))
