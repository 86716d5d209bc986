"""Shards computed on first use: a process hosting every rank sums their products in cache.

A data-parallel weight gradient is, on each rank, the product of that rank's own rows
(``x_r.T @ g_r``): a Partial sum, which the gradient's all-reduce adds up in rank order. A
process hosting all ranks (the simulator) would write every rank's whole product (16 MB each
at hidden 1024, eight of them) and read them all back to add them, where one device writes one
(``benchmarks/dispatch_overhead.py --breakdown``: the weight gradients and their sum are most
of what the data-parallel step costs beyond dense).

So when an op whose kernel is a product makes a Partial(sum) output on several hosted ranks,
dispatch defers it: the output tensor holds a ``DeferredShards`` instead of its shards. If the
first thing that happens to it is its all-reduce, the communicator gets the per-rank
``Product`` pieces and ``reduce_arrays`` sums them block by block while each block of every
product is in cache (the op's ``product_sum``); the products themselves are never written.
The result is the same bytes as summing the written products in rank order, which the op's
``product_sum`` checks before it relies on it. Anything else that reads the tensor's
``_shards`` computes them exactly as the op would have (``tensor._ShardsOnFirstUse``).

The operands are captured when the op runs: arrays are read-only values, and an optimizer
updates a parameter's array in place only when nothing else references it (a deferred
product does), so they cannot change before the products are computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Array = Any


class DeferredShards:
    """The shards of an op's output, computed on first request (``shards``) unless a sum of
    the per-rank ``products`` is all that is ever asked for."""

    def __init__(self, compute: Callable[[], dict[int, Array]]) -> None:
        self._compute: Callable[[], dict[int, Array]] | None = compute
        self._shards: dict[int, Array] | None = None
        self.products: dict[int, Product] = {}

    @property
    def computed(self) -> bool:
        return self._shards is not None

    def shards(self) -> dict[int, Array]:
        if self._shards is None:
            assert self._compute is not None
            self._shards = self._compute()
            # Written out: the operands need not stay alive for as long as the tensor does.
            self._compute = None
            self.products = {}
        return self._shards


@dataclass(eq=False)
class Product:
    """One rank's deferred product: what a communicator receives in place of the array."""

    operands: tuple[Array, ...]
    attrs: dict[str, Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    product_sum: Callable[[Sequence[Product]], Array | None]
    """The op's in-order sum of several ranks' products, or None where it cannot give the
    written products' sum bit for bit."""
    owner: DeferredShards = field(repr=False)
    rank: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def array(self) -> Array:
        """This rank's product, written out (all ranks' are computed together)."""
        return self.owner.shards()[self.rank]


def sum_products(pieces: Sequence[Any], op: str) -> Array | None:
    """``((p0 + p1) + p2) + ...`` of deferred products without writing each one, or None (not
    all products of one op, another reduction, or the op declines)."""
    first = pieces[0]
    if op != "sum" or not all(isinstance(p, Product) and p.product_sum is first.product_sum for p in pieces):
        return None
    return first.product_sum(pieces)


def written(pieces: Sequence[Any]) -> list[Array]:
    """Every deferred product in ``pieces`` written out; arrays stay as they are."""
    return [p.array() if isinstance(p, Product) else p for p in pieces]
