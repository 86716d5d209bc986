"""Autograd semantics: accumulation across backward calls, stop_gradient and no_grad, in-place marking."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.ops import math as M


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


@pytest.mark.parametrize("placements", [None, [dist.Shard(0)], [dist.Partial()]])
def test_the_square_s_gradient_is_its_product_twice_bit_for_bit(placements: list[Any] | None) -> None:
    """``z * z`` makes its gradient's product once (both inputs are one value in one layout) and
    the engine adds it to itself: the bits of ``g z + g z``, computed here by hand in NumPy."""
    rng = np.random.default_rng(3)
    value = rng.standard_normal((8, 5)).astype(np.float32)
    seed = rng.standard_normal((8, 5)).astype(np.float32)
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    z = dist.Parameter(value) if placements is None else dist.shard_tensor(dist.Parameter(value), mesh, placements)
    out = dist.multiply(z, z)
    out.backward(dist.Tensor(seed) if placements is None else dist.shard_tensor(seed, mesh, [dist.Replicate()]))
    got = z.grad.numpy() if placements is None else z.grad.full_tensor()
    want = seed * value + seed * value  # (a Partial parameter is read whole: its sum is ``value``)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def test_a_square_multiplies_once_in_backward_and_two_storages_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of ``z * z`` runs one product; of ``a * b`` two, even when ``a`` and ``b``
    hold equal values (two storages are not a square), each gradient the other's value times
    the seed."""
    products: list[int] = []
    real = M.multiply

    def counted(x: Any, y: Any, name: str | None = None) -> Any:
        products.append(1)
        return real(x, y)

    monkeypatch.setattr(M, "multiply", counted)
    seed = np.array([0.5, -1.0, 2.0])
    z = dist.Parameter(np.array([1.0, 2.0, 3.0]))
    real(z, z).backward(dist.Tensor(seed))
    assert len(products) == 1 and np.array_equal(z.grad.numpy(), seed * z.numpy() + seed * z.numpy())
    products.clear()
    a = dist.Parameter(np.array([1.0, 2.0, 3.0]))
    b = dist.Parameter(np.array([1.0, 2.0, 3.0]))
    real(a, b).backward(dist.Tensor(seed))
    assert len(products) == 2
    assert np.array_equal(a.grad.numpy(), seed * b.numpy()) and np.array_equal(b.grad.numpy(), seed * a.numpy())
