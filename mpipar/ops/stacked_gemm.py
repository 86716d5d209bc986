"""One GEMM for the ranks of a row-split matmul hosted in one process, bit for bit.

In a data-parallel (or sequence-parallel) matmul every rank multiplies its own rows of ``x``
by the same replicated ``y``. A process that hosts all ranks (the simulator) would make one
BLAS call per rank, and each call packs the whole of ``y`` again: at hidden 1024 and 512
tokens on 8 ranks, eight 64-row calls take 36.6 ms where one 512-row call takes 27.6 ms
(``benchmarks/dispatch_overhead.py --breakdown``). Stacking the ranks' rows into one call
gives the dense GEMM's time.

The results must stay those of the per-rank calls bit for bit: the MPI runtime computes each
rank's rows on their own, and the simulator promises the same bytes. A GEMM's element
``(i, j)`` is row ``i`` of ``x`` against column ``j`` of ``y``, accumulated in the order the
BLAS kernel walks the shared dimension; OpenBLAS splits the rows and columns among blocks and
threads but never that dimension, so a row's result usually does not depend on the rows
beside it. That is a property of one BLAS library's GEMM, not a promise of every one, so:

* only GEMMs are combined: NumPy hands a product with one row or one column to GEMV, whose
  kernels treat a block of rows and the leftover rows differently (seen: a row of a 5-row
  GEMV differs from the same row computed in a 2-row one), and ``a @ a.T`` on one buffer to
  SYRK; such calls, and operands that share memory, are left alone;
* even GEMMs differ: with OpenBLAS 0.3.31 (NumPy's wheel, Haswell kernels), 8-row float64
  pieces at k=512 give other bits alone than inside a 64-row call (16-row pieces, or k=257,
  do not), probably because calls that small take its small-matrix path, which sums k in one
  pass where the blocked path sums two blocks of 256. So it is *checked* for each signature
  before it is relied on: operands of exactly the call's shapes, strides and dtypes, filled
  with values of widely spread magnitudes (so that any other order of additions shows in the
  last bits), computed both ways twice, must give equal bytes; otherwise the ranks keep one
  call each.

The check sees shapes, strides and dtypes, not addresses: a BLAS whose results depend on the
data's alignment (MKL outside its conditional-reproducibility mode) could pass it and still
differ on real arrays. There, ``MPIPAR_STACK_GEMMS=0`` turns both shortcuts off (the
data-parallel weight gradients' sums, ``product_sum`` below, too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar.comm import reduce_arrays
from mpipar.env import env_flag

Array = Any

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

STACK_ELEMENTS = 1 << 16
"""A shared operand smaller than this is multiplied per rank: each call packs it again, which
for fewer elements costs less than the checks and the stacking copy (tens of microseconds)."""

_VERIFIED: dict[tuple[Any, ...], bool] = {}
"""Signature -> did one stacked GEMM equal the per-rank GEMMs bit for bit."""

_SUMS_VERIFIED: dict[tuple[Any, ...], bool] = {}
"""Signature -> did the tiled sum equal the rank-ordered sum of the written products."""

_TILE_BYTES = 1 << 19
"""A tile of the sum and of one product: 512 KiB each, so both stay in a core's L2 (2 MiB
here; 512 KiB and 1 MiB tiles measured alike, 128 KiB and 2 MiB slower)."""


def enabled() -> bool:
    return env_flag("MPIPAR_STACK_GEMMS", True)


def _probe_like(a: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """An array of ``a``'s shape, dtype and strides (C or Fortran order, a broadcast, a slice),
    so that NumPy hands it to BLAS as it hands ``a``, holding values whose magnitudes spread
    over 2**-12..2**12: summed in another order, such values round differently. None for
    negative strides."""
    if any(s < 0 for s in a.strides):
        return None
    extent = sum((n - 1) * s for n, s in zip(a.shape, a.strides, strict=True)) // a.itemsize + 1 if a.size else 1
    base = (rng.standard_normal(extent) * np.exp2(rng.integers(-12, 13, extent))).astype(a.dtype)
    return np.lib.stride_tricks.as_strided(base, a.shape, a.strides, writeable=False)


def _gemm_shaped(m: int, n: int) -> bool:
    """Does NumPy compute an (m, k) @ (k, n) product with GEMM (not GEMV, not a dot)?"""
    return m >= 2 and n >= 2


def _overlapping(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> bool:
    """May the two operands of any product share memory (NumPy gives ``a @ a.T`` to SYRK)?"""
    return any(np.may_share_memory(a, b) for a, b in pairs)


def _stacked_equals_pieces(xs: Sequence[np.ndarray], y: np.ndarray, trans_y: bool) -> bool:
    """Does this BLAS, on operands laid out as these, give every piece's product bit for bit
    from one call on the stacked rows? Checked on two sets of values."""
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        y_probe = _probe_like(y, rng)
        pieces = [_probe_like(x, rng) for x in xs]
        if y_probe is None or any(p is None for p in pieces):
            return False
        rhs = y_probe.T if trans_y else y_probe
        stacked = np.matmul(np.concatenate(pieces), rhs)  # type: ignore[arg-type]
        start = 0
        for piece in pieces:
            assert piece is not None
            if not np.array_equal(stacked[start : start + piece.shape[0]], np.matmul(piece, rhs)):
                return False
            start += piece.shape[0]
    return True


def stacked_matmul(xs: Sequence[Array], y: Array, trans_y: bool) -> list[np.ndarray] | None:
    """``[x @ y for x in xs]`` (``y`` transposed when ``trans_y``) as one GEMM on the stacked
    rows, returned as row views of its result; None when it is not checked to give the same
    bits or the operands do not fit (not 2-d float NumPy arrays of one dtype, a piece of one
    row, ``y`` of one column or under ``STACK_ELEMENTS``, shared memory, fewer than two
    pieces). The check runs once per
    signature: the pieces' and ``y``'s shapes, strides and dtypes, which decide how NumPy
    calls BLAS."""
    if len(xs) < 2 or type(y) is not np.ndarray or y.size < STACK_ELEMENTS or y.ndim != 2 or y.dtype not in _FLOATS:
        return None
    if not enabled():
        return None
    k, n = (y.shape[1], y.shape[0]) if trans_y else y.shape
    first = xs[0]
    for x in xs:
        if (
            type(x) is not np.ndarray
            or x.ndim != 2
            or x.dtype != first.dtype
            or x.dtype not in _FLOATS
            or x.shape[1] != k
        ):
            return None
        if x.shape[0] and not _gemm_shaped(x.shape[0], n):
            return None
    if _overlapping([(x, y) for x in xs]):
        return None
    signature = (tuple((x.shape, x.strides) for x in xs), first.dtype.str, y.shape, y.strides, y.dtype.str, trans_y)
    same = _VERIFIED.get(signature)
    if same is None:
        same = _VERIFIED[signature] = _stacked_equals_pieces(xs, y, trans_y)
    if not same:
        return None
    out = np.matmul(np.concatenate(xs), y.T if trans_y else y)
    starts = np.cumsum((0, *(x.shape[0] for x in xs)))
    return [out[starts[i] : starts[i + 1]] for i in range(len(xs))]


def _tile(extent: int, line_bytes: int) -> int:
    """Rows (or columns) per tile: as many as fit ``_TILE_BYTES``, at least 2, and never a
    last tile of one (a one-row product would go to GEMV)."""
    size = max(2, min(extent, _TILE_BYTES // max(1, line_bytes)))
    while extent % size == 1 and size < extent:
        size += 1
    return size


def _tiled_sum(lhs: Sequence[np.ndarray], rhs: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """``((l0 @ r0 + l1 @ r1) + l2 @ r2) + ...`` computed one tile of the result at a time: each
    tile of each product is written to a cache-sized buffer and added while it is still there.

    Tiles are rows when the result has at least as many rows as columns, else columns: each
    call packs the whole of the operand the tile does not cut, so that one should be the
    smaller. An operand neither C nor Fortran ordered (a broadcast gradient) is copied once,
    as NumPy would copy it for every call."""
    lhs = [a if a.flags.c_contiguous or a.flags.f_contiguous else np.ascontiguousarray(a) for a in lhs]
    rhs = [b if b.flags.c_contiguous or b.flags.f_contiguous else np.ascontiguousarray(b) for b in rhs]
    pairs = list(zip(lhs, rhs, strict=True))
    m, n = lhs[0].shape[0], rhs[0].shape[1]
    out = np.empty((m, n), dtype)
    if n <= m:
        rows = _tile(m, n * dtype.itemsize)
        buf = np.empty((rows, n), dtype)
        for start in range(0, m, rows):
            acc = out[start : start + rows]  # a row tile of the result is contiguous: summed in place
            _sum_products(acc, buf[: acc.shape[0]], [(a[start : start + rows], b) for a, b in pairs])
        return out
    cols = _tile(n, m * dtype.itemsize)
    buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for start in range(0, n, cols):
        width = min(cols, n - start)
        if width not in buffers:
            buffers[width] = (np.empty((m, width), dtype), np.empty((m, width), dtype))
        acc, tile = buffers[width]  # a column tile is not: summed in a buffer, then copied out
        _sum_products(acc, tile, [(a, b[:, start : start + width]) for a, b in pairs])
        out[:, start : start + width] = acc
    return out


def _sum_products(acc: np.ndarray, tile: np.ndarray, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``acc`` = ``((p0 + p1) + p2) + ...`` of the products of ``pairs``, each written to ``tile``
    and added while it is in cache (the first straight into ``acc``)."""
    np.matmul(pairs[0][0], pairs[0][1], out=acc)
    for left, right in pairs[1:]:
        np.matmul(left, right, out=tile)
        np.add(acc, tile, out=acc)


def _tiled_sum_equals_reduction(lhs: Sequence[np.ndarray], rhs: Sequence[np.ndarray], dtype: np.dtype) -> bool:
    """Does ``_tiled_sum``, on operands laid out as these, give the rank-ordered sum of the
    written products (``reduce_arrays``, what every communicator computes) bit for bit?
    Checked on two sets of values."""
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        left_probes = [_probe_like(a, rng) for a in lhs]
        right_probes = [_probe_like(b, rng) for b in rhs]
        left = [a for a in left_probes if a is not None]
        right = [b for b in right_probes if b is not None]
        if len(left) < len(lhs) or len(right) < len(rhs):
            return False
        want = reduce_arrays([np.matmul(a, b) for a, b in zip(left, right, strict=True)], "sum")
        if not np.array_equal(_tiled_sum(left, right, dtype), want):
            return False
    return True


def product_sum(
    pairs: Sequence[tuple[Array, Array]], trans_x: bool, trans_y: bool, dtype: np.dtype
) -> np.ndarray | None:
    """The rank-ordered sum of the ranks' matmuls ``x @ y`` (each transposed as the flags say)
    without writing any of them, bit for bit what summing the written products gives; None
    when that is not checked to hold or the operands do not fit (not 2-d float NumPy arrays,
    products of other shapes or of another dtype than ``dtype``, one row or one column,
    shared memory)."""
    if len(pairs) < 2 or not enabled():
        return None
    lhs, rhs = [], []
    for x, y in pairs:
        if type(x) is not np.ndarray or type(y) is not np.ndarray or x.ndim != 2 or y.ndim != 2:
            return None
        lhs.append(x.T if trans_x else x)
        rhs.append(y.T if trans_y else y)
    m, n = lhs[0].shape[0], rhs[0].shape[1]
    if not _gemm_shaped(m, n):
        return None
    for a, b in zip(lhs, rhs, strict=True):
        if (
            a.dtype not in _FLOATS
            or np.result_type(a, b) != dtype
            or a.shape[0] != m
            or b.shape[1] != n
            or a.shape[1] != b.shape[0]
        ):
            return None
        if any(s < 0 for s in (*a.strides, *b.strides)):
            return None
    if _overlapping(list(zip(lhs, rhs, strict=True))):
        return None
    shapes = tuple(
        (a.shape, a.strides, a.dtype.str, b.shape, b.strides, b.dtype.str) for a, b in zip(lhs, rhs, strict=True)
    )
    signature = (shapes, dtype.str, _TILE_BYTES)
    same = _SUMS_VERIFIED.get(signature)
    if same is None:
        same = _SUMS_VERIFIED[signature] = _tiled_sum_equals_reduction(lhs, rhs, dtype)
    return _tiled_sum(lhs, rhs, dtype) if same else None
