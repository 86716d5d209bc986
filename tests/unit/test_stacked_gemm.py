"""The simulator's GEMM shortcuts give the per-rank bits (``mpipar.ops.stacked_gemm``,
``mpipar._deferred``).

A process hosting every rank multiplies a row-split ``x`` by a shared ``y`` in one stacked
GEMM, and sums a Partial matmul's per-rank products (data-parallel weight gradients) a tile at
a time without writing them. Both must equal, bit for bit, what one call per rank and the
rank-ordered sum of the written products give, which is what the MPI runtime computes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_scripts.dp_mlp_digest import digests
from mpi_scripts.launch import mpirun

import mpipar as dist
from mpipar import _deferred
from mpipar.comm import reduce_arrays
from mpipar.ops import dispatch, stacked_gemm
from simulator import SimBackend

F = dist.nn.functional


def _operand(rng: np.random.Generator, shape: tuple[int, int], dtype: type, layout: str) -> np.ndarray:
    """``shape`` in C order, Fortran order, as a row slice of a wider array, or broadcast."""
    if layout == "broadcast":
        return np.broadcast_to(rng.standard_normal(shape[1]).astype(dtype), shape)
    if layout == "slice":
        return rng.standard_normal((shape[0], shape[1] + 3)).astype(dtype)[:, 1 : shape[1] + 1]
    a = rng.standard_normal(shape).astype(dtype)
    return np.asfortranarray(a) if layout == "F" else a


LAYOUTS = st.sampled_from(["C", "F", "slice", "broadcast"])
FLOATS = {"dtype": st.sampled_from([np.float32, np.float64]), "seed": st.integers(0, 2**16)}


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, 40), min_size=2, max_size=6),
    k=st.integers(1, 70),
    n=st.integers(1, 90),
    trans_y=st.booleans(),
    x_layout=LAYOUTS,
    y_layout=st.sampled_from(["C", "F", "slice"]),
    **FLOATS,
)
def test_stacked_matmul_gives_each_ranks_bits(
    rows: list[int], k: int, n: int, dtype: type, trans_y: bool, x_layout: str, y_layout: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    xs = [_operand(rng, (m, k), dtype, x_layout) for m in rows]
    y = _operand(rng, (n, k) if trans_y else (k, n), dtype, y_layout)
    saved = stacked_gemm.STACK_ELEMENTS
    stacked_gemm.STACK_ELEMENTS = 0  # small operands too (dispatch leaves them per rank)
    try:
        got = stacked_gemm.stacked_matmul(xs, y, trans_y)
    finally:
        stacked_gemm.STACK_ELEMENTS = saved
    if got is None:  # dispatch then makes one call per rank
        gemms = n >= 2 and 1 not in rows  # else NumPy calls GEMV for some piece: never combined
        assert not gemms or stacked_gemm._VERIFIED.get(_signature(xs, y, trans_y)) is False
        return
    for x, out in zip(xs, got, strict=True):
        want = np.matmul(x, y.T if trans_y else y)
        assert out.shape == want.shape and out.dtype == want.dtype and out.flags.c_contiguous
        assert np.array_equal(out, want)


def _signature(xs: list[np.ndarray], y: np.ndarray, trans_y: bool) -> tuple[object, ...]:
    return (tuple((x.shape, x.strides) for x in xs), xs[0].dtype.str, y.shape, y.strides, y.dtype.str, trans_y)


@settings(max_examples=40, deadline=None)
@given(
    ks=st.lists(st.integers(0, 30), min_size=2, max_size=6),
    m=st.integers(1, 60),
    n=st.integers(1, 60),
    trans_x=st.booleans(),
    trans_y=st.booleans(),
    x_layout=LAYOUTS,
    y_layout=LAYOUTS,
    tile_bytes=st.sampled_from([8, 200, 1 << 19]),
    **FLOATS,
)
def test_product_sum_is_the_rank_ordered_sum_of_the_written_products(
    ks: list[int],
    m: int,
    n: int,
    dtype: type,
    trans_x: bool,
    trans_y: bool,
    x_layout: str,
    y_layout: str,
    tile_bytes: int,
    seed: int,
) -> None:
    """Uneven contraction lengths per rank (an uneven batch split), both tilings (rows when the
    result is tall, columns when wide), tiles from one element to the whole result."""
    rng = np.random.default_rng(seed)
    pairs = []
    for k in ks:
        x = _operand(rng, (k, m) if trans_x else (m, k), dtype, x_layout)
        y = _operand(rng, (n, k) if trans_y else (k, n), dtype, y_layout)
        pairs.append((x, y))
    want = reduce_arrays([np.matmul(x.T if trans_x else x, y.T if trans_y else y) for x, y in pairs], "sum")
    saved = stacked_gemm._TILE_BYTES
    stacked_gemm._TILE_BYTES = tile_bytes
    try:
        got = stacked_gemm.product_sum(pairs, trans_x, trans_y, np.dtype(dtype))
    finally:
        stacked_gemm._TILE_BYTES = saved
    if got is not None:
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)


def _mlp_step(monkeypatch: pytest.MonkeyPatch, stack: bool, hidden: int = 256, tokens: int = 512) -> dict[str, object]:
    """A data-parallel MLP step on 8 simulated ranks (float64): gradients and all-reduces, one per
    gradient (the default buckets off: a Partial gradient left deferred is what the tiled sum reads)."""
    monkeypatch.setenv("MPIPAR_STACK_GEMMS", "1" if stack else "0")
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")
    dist.set_backend(SimBackend(8))
    mesh = dist.ProcessMesh(list(range(8)), dim_names=["dp"])
    rng = np.random.default_rng(3)
    x = dist.shard_tensor(rng.standard_normal((tokens, hidden)), mesh, [dist.Shard(0)])
    w0 = dist.shard_tensor(dist.Parameter(rng.standard_normal((hidden, 4 * hidden))), mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((4 * hidden, hidden))), mesh, [dist.Replicate()])
    with dist.CommDebugMode() as comm:
        loss = dist.mean(dist.matmul(F.relu(dist.matmul(x, w0)), w1) ** 2)
        loss.backward()
    events = [(e.op, e.ranks, e.input_nbytes, e.output_nbytes, e.dtype, e.reduce_type) for e in comm.events]
    return {"loss": float(loss), "dw0": w0.grad.full_tensor(), "dw1": w1.grad.full_tensor(), "events": events}


def _count_shortcuts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counters, live: GEMMs stacked, Partial products summed by tiles, deferred products written."""
    calls = {"stacked": 0, "summed": 0, "written": 0}
    stacked, summed, written = stacked_gemm.stacked_matmul, stacked_gemm.product_sum, _deferred.DeferredShards.shards

    def count_stacked(*args: object) -> object:
        out = stacked(*args)  # type: ignore[arg-type]
        calls["stacked"] += out is not None
        return out

    def count_summed(*args: object) -> object:
        out = summed(*args)  # type: ignore[arg-type]
        calls["summed"] += out is not None
        return out

    def count_written(self: _deferred.DeferredShards) -> object:
        calls["written"] += not self.computed
        return written(self)

    monkeypatch.setattr(stacked_gemm, "stacked_matmul", count_stacked)
    monkeypatch.setattr(stacked_gemm, "product_sum", count_summed)
    monkeypatch.setattr(_deferred.DeferredShards, "shards", count_written)
    return calls


def test_data_parallel_step_takes_both_shortcuts_with_the_per_rank_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_shortcuts(monkeypatch)
    fast = _mlp_step(monkeypatch, stack=True)
    # Forward x @ w0 and h @ w1, backward's input gradient: one GEMM each; both weight
    # gradients summed without writing the eight products. (The checks pass on the OpenBLAS
    # that NumPy's wheels bundle. With 8-row pieces at k=512 in float64 they do not, and are
    # right not to: an 8-row call there gives other bits than the same rows in a 64-row call,
    # seen with OpenBLAS 0.3.31; probably its small-matrix path, which sums k in one pass.)
    assert calls == {"stacked": 3, "summed": 2, "written": 0}
    calls.update(stacked=0, summed=0, written=0)
    slow = _mlp_step(monkeypatch, stack=False)
    assert calls == {"stacked": 0, "summed": 0, "written": 2}  # deferred, then written out and summed as usual
    assert fast["loss"] == slow["loss"]
    assert np.array_equal(fast["dw0"], slow["dw0"]) and np.array_equal(fast["dw1"], slow["dw1"])  # type: ignore[arg-type]
    assert fast["events"] == slow["events"]  # the same collectives, the same bytes
    assert [e[0] for e in fast["events"]] == ["all_reduce", "all_reduce"]  # the two weight gradients


def test_a_deferred_partial_is_written_out_for_any_other_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-parallel matmul: its Partial output is deferred, and a detached view shares the
    deferral; adding it to itself (Partial + Partial stays Partial) writes the products out once,
    for both, as the kernel would have; a fresh one is summed while deferred by ``full_tensor``;
    every route reaches the sum of the per-rank products."""
    monkeypatch.setattr(dispatch, "_DEFER_ELEMENTS", 1)  # small outputs too
    dist.set_backend(SimBackend(4))
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["mp"])
    rng = np.random.default_rng(5)
    xa, wa = rng.standard_normal((6, 20)), rng.standard_normal((20, 7))
    x = dist.shard_tensor(xa, mesh, [dist.Shard(1)])
    w = dist.shard_tensor(wa, mesh, [dist.Shard(0)])
    y = dist.matmul(x, w)
    assert y.placements == [dist.Partial()]
    assert y._deferred_shards() is not None
    view = y.detach()
    assert view._deferred_shards() is y._deferred_shards()  # shared, still not written
    doubled = dist.add(y, y)
    assert y._deferred_shards() is None and view._deferred_shards() is None  # written once, for both
    pieces = [xa[:, 5 * r : 5 * r + 5] @ wa[5 * r : 5 * r + 5] for r in range(4)]
    for r in range(4):
        assert np.array_equal(y._shards[r], pieces[r]) and np.array_equal(view._shards[r], pieces[r])
    assert np.array_equal(doubled.full_tensor(), reduce_arrays([p + p for p in pieces], "sum"))
    z = dist.matmul(x, w)
    assert np.array_equal(z.full_tensor(), reduce_arrays(pieces, "sum"))  # summed while deferred
    assert z._deferred_shards() is not None


def test_a_refusing_check_keeps_one_call_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the check finds other bits (another BLAS), neither shortcut is taken and the
    results are still the per-rank ones."""
    monkeypatch.setattr(stacked_gemm, "STACK_ELEMENTS", 0)
    monkeypatch.setattr(stacked_gemm, "_VERIFIED", {})
    monkeypatch.setattr(stacked_gemm, "_SUMS_VERIFIED", {})
    monkeypatch.setattr(stacked_gemm, "_stacked_equals_pieces", lambda *a: False)
    monkeypatch.setattr(stacked_gemm, "_tiled_sum_equals_reduction", lambda *a: False)
    monkeypatch.setattr(stacked_gemm, "_tiled_sum", lambda *a: pytest.fail("summed tile by tile after a refusal"))
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((4, 3)) for _ in range(3)]
    assert stacked_gemm.stacked_matmul(xs, rng.standard_normal((3, 5)), False) is None
    pairs = [(rng.standard_normal((4, 3)), rng.standard_normal((4, 5))) for _ in range(3)]
    assert stacked_gemm.product_sum(pairs, True, False, np.dtype(np.float64)) is None
    refused = _mlp_step(monkeypatch, stack=True)
    monkeypatch.undo()
    plain = _mlp_step(monkeypatch, stack=False)
    assert np.array_equal(refused["dw0"], plain["dw0"]) and np.array_equal(refused["dw1"], plain["dw1"])  # type: ignore[arg-type]


@pytest.mark.mpi
def test_the_shortcuts_give_the_bits_of_the_mpi_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``mpiexec -n 4`` each rank multiplies its own 128 rows and the gradients are summed
    over MPI; the simulator, taking both shortcuts (counted), prints the same digests."""
    taken = _count_shortcuts(monkeypatch)
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")  # per-gradient sums (the tiled-sum shortcut), here and there
    dist.set_backend(SimBackend(4))
    sim = digests(4)
    assert taken == {"stacked": 6, "summed": 4, "written": 0}  # per dtype: 3 GEMMs stacked, 2 gradients summed
    run = mpirun(4, "tests/mpi_scripts/dp_mlp_digest.py", timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    got = dict(line.split()[1:] for line in run.lines_of(0) if line.startswith("digest "))
    assert got == sim
