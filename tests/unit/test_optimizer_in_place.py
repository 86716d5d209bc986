"""SGD overwrites a parameter's shard only when nothing but the parameter holds it.

On one hosted rank (a one-rank mesh here, every process under MPI) the update writes into
the old shard instead of allocating a new one; the bits are those of the out-of-place update,
and anything that shares the old value (a detached view, a slice) keeps it.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpipar as dist
from mpipar.optimizer.sgd_momentum_adam import SGD


def _train(steps: int, keep: list[dist.Tensor] | None = None) -> tuple[np.ndarray, list[int]]:
    """``steps`` SGD steps of a small linear model on a one-rank mesh (float64); the final
    weight and the id of its shard after each step. ``keep`` collects a detached view of the
    weight before each step when given."""
    mesh = dist.ProcessMesh([0], dim_names=["x"])
    rng = np.random.default_rng(3)
    x = dist.shard_tensor(rng.standard_normal((6, 5)), mesh, [dist.Replicate()])
    w = dist.shard_tensor(dist.Parameter(rng.standard_normal((5, 3))), mesh, [dist.Shard(1)])
    b = dist.shard_tensor(dist.Parameter(rng.standard_normal(3)), mesh, [dist.Replicate()])
    opt = dist.optimizer.SGD(learning_rate=0.05, parameters=[w, b], weight_decay=0.01)
    ids = []
    for _ in range(steps):
        if keep is not None:
            keep.append(w.detach())
        y = dist.add(dist.matmul(x, w), b)
        dist.mean(dist.multiply(y, y)).backward()
        opt.step()
        opt.clear_grad()
        ids.append(id(w.local_tensor()))
    return w.full_tensor(), ids


def test_in_place_update_is_bit_identical_to_out_of_place(monkeypatch: pytest.MonkeyPatch) -> None:
    got, ids = _train(5)
    assert len(set(ids[1:])) == 1, "from the second step on, the shard should be updated in place"
    monkeypatch.setattr(SGD, "updates_in_place", False)
    want, fresh_ids = _train(5)
    assert got.tobytes() == want.tobytes()
    assert len(set(fresh_ids)) > 1  # out of place: new arrays


def test_shard_frozen_after_in_place_update() -> None:
    mesh = dist.ProcessMesh([0], dim_names=["x"])
    w = dist.shard_tensor(dist.Parameter(np.ones((4, 2))), mesh, [dist.Replicate()])
    opt = dist.optimizer.SGD(learning_rate=0.5, parameters=[w])
    for _ in range(2):
        dist.sum(w).backward()
        opt.step()
        opt.clear_grad()
    shard = w.local_tensor()
    assert not shard.flags.writeable
    np.testing.assert_array_equal(shard, np.zeros((4, 2)))


def test_shared_values_are_never_overwritten() -> None:
    views: list[dist.Tensor] = []
    _, ids = _train(4, keep=views)
    # Each step a detached view held the old value, so no update could write into it.
    assert len(set(ids)) == len(ids)
    values = [v.local_tensor().copy() for v in views]
    again: list[dist.Tensor] = []
    _train(4, keep=again)
    for v, old in zip(again, values, strict=True):
        assert v.local_tensor().tobytes() == old.tobytes()
    # A slice of the shard held across a step keeps its contents too.
    mesh = dist.ProcessMesh([0], dim_names=["x"])
    w = dist.shard_tensor(dist.Parameter(np.full((3, 2), 2.0)), mesh, [dist.Replicate()])
    opt = dist.optimizer.SGD(learning_rate=1.0, parameters=[w])
    dist.sum(w).backward()
    opt.step()
    opt.clear_grad()
    row = w.local_tensor()[0]
    dist.sum(w).backward()
    opt.step()
    np.testing.assert_array_equal(row, [1.0, 1.0])
    np.testing.assert_array_equal(w.local_tensor(), np.zeros((3, 2)))
