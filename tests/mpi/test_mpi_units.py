"""Pieces of the MPI runtime that need no launcher: settings, signatures, output, print_once."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar.comm import _BLOCK_ELEMS, fold_into, reduce_arrays, reduce_rows
from mpipar.runtime.faults import (
    Waiting,
    Watchdog,
    check_from_env,
    compare_signatures,
    signature,
    timeout_from_env,
)
from mpipar.runtime.log import LinePrefixer
from mpipar.runtime.ordered import ResultCache, cache_bytes_from_env, reduce_mode_from_env


def test_timeout_setting() -> None:
    assert timeout_from_env({}) == 300.0
    assert timeout_from_env({"MPIPAR_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=f"MPIPAR_TIMEOUT='{bad}' is not a number of seconds > 0"):
            timeout_from_env({"MPIPAR_TIMEOUT": bad})


def test_check_setting() -> None:
    assert not check_from_env({})
    assert check_from_env({"MPIPAR_CHECK_COLLECTIVES": "1"}) and check_from_env({"MPIPAR_CHECK_COLLECTIVES": "on"})
    assert not check_from_env({"MPIPAR_CHECK_COLLECTIVES": "0"})
    with pytest.raises(
        ValueError, match=r"MPIPAR_CHECK_COLLECTIVES='maybe' is not a boolean; use 1/true/on/yes or 0/false/off/no"
    ):
        check_from_env({"MPIPAR_CHECK_COLLECTIVES": "maybe"})


def test_reduce_mode_setting() -> None:
    assert reduce_mode_from_env({}) == "ordered"
    assert reduce_mode_from_env({"MPIPAR_REDUCE": " Native "}) == "native"
    assert reduce_mode_from_env({"MPIPAR_REDUCE": "ordered"}) == "ordered"
    with pytest.raises(
        ValueError, match=r"MPIPAR_REDUCE='mpi' is not one of ordered, native \(ordered: sums in group order"
    ):
        reduce_mode_from_env({"MPIPAR_REDUCE": "mpi"})


def test_matching_signatures_pass() -> None:
    sig = signature("all_reduce", dtype="float64", reduce_type="sum", shape=(4, 3))
    assert compare_signatures((0, 1, 2), [sig, sig, sig], 1) is None


def test_different_ops_name_every_rank() -> None:
    ar = signature("all_reduce", dtype="float64", reduce_type="sum", shape=(4, 3))
    ag = signature("all_gather", dtype="float64", shapes=[(2, 3), (2, 3)])
    msg = compare_signatures((3, 1, 0), [ar, ag, ar], 7)
    assert msg is not None
    assert "group [3, 1, 0] (call #7 on this group)" in msg
    assert "ranks [3, 0] issued all_reduce(sum) of float64[4, 3]" in msg
    assert "rank 1 issued all_gather of float64 pieces [[2, 3], [2, 3]]" in msg


def test_same_op_other_dtype_or_root() -> None:
    a = signature("broadcast", dtype="float64", shape=(2,), root=1)
    b = signature("broadcast", dtype="float32", shape=(2,), root=1)
    msg = compare_signatures((0, 1), [a, b], 2)
    assert msg is not None and "rank 0 issued broadcast of float64[2] (root 1)" in msg and "float32[2]" in msg
    c = signature("reduce", dtype="float64", reduce_type="max", shape=(2,), root=0)
    d = signature("reduce", dtype="float64", reduce_type="max", shape=(2,), root=1)
    msg = compare_signatures((0, 1), [c, d], 3)
    assert msg is not None and "(root 0)" in msg and "(root 1)" in msg


def test_all_to_all_layout_disagreement() -> None:
    a = signature("all_to_all", dtype="int64", sends=[(1,), (2,)], recvs=[(1,), (3,)])
    b = signature("all_to_all", dtype="int64", sends=[(3,), (0,)], recvs=[(2,), (0,)])
    assert compare_signatures((0, 1), [a, b], 1) is None
    b_wrong = signature("all_to_all", dtype="int64", sends=[(4,), (0,)], recvs=[(2,), (0,)])
    msg = compare_signatures((0, 1), [a, b_wrong], 1)
    assert msg is not None and "rank 1 sends a piece of shape [4] to rank 0, which expects [3]" in msg


def test_line_prefixer_writes_whole_prefixed_lines() -> None:
    sink = io.StringIO()
    out = LinePrefixer(sink, "[rank 3] ")  # type: ignore[arg-type]
    out.write("a")
    assert sink.getvalue() == ""  # a partial line waits for its end
    out.write("b\nc\nd")
    assert sink.getvalue() == "[rank 3] ab\n[rank 3] c\n"
    out.flush()
    assert sink.getvalue() == "[rank 3] ab\n[rank 3] c\n[rank 3] d"
    print("x", "y", file=out)
    assert sink.getvalue().endswith("[rank 3] x y\n")


def test_print_once_prints_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    dist.print_once("step", 1, "loss", 0.5)
    assert capsys.readouterr().out == "step 1 loss 0.5\n"


# ---------------------------------------------------------------------- the result cache
MIB = 2**20


def test_cache_setting() -> None:
    assert cache_bytes_from_env({}) == 256 * MIB
    assert cache_bytes_from_env({"MPIPAR_COMM_CACHE_MIB": "0"}) == 0
    assert cache_bytes_from_env({"MPIPAR_COMM_CACHE_MIB": "1.5"}) == int(1.5 * MIB)
    for bad in ("-1", "lots", "inf", "nan"):
        with pytest.raises(ValueError, match=f"MPIPAR_COMM_CACHE_MIB='{bad}' is not a number of MiB >= 0"):
            cache_bytes_from_env({"MPIPAR_COMM_CACHE_MIB": bad})


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.mark.parametrize(
    "hold",
    [
        lambda x: x,
        lambda x: x.reshape(2, -1),  # views of views keep the owner as their base
        lambda x: x[10:20],
        lambda x: memoryview(x),
        lambda x: np.ndarray((4,), dtype=x.dtype, buffer=x),
        lambda x: x.view(np.int64),
    ],
    ids=["array", "reshape", "slice", "memoryview", "ndarray-on-buffer", "dtype-view"],
)
def test_cache_reuses_a_buffer_only_once_nothing_references_it(hold: object) -> None:
    cache = ResultCache(idle_limit=64 * MIB)
    a = cache.take(MIB // 8, np.float64)
    assert a.shape == (MIB // 8,) and a.dtype == np.float64
    where = _address(a)
    kept = hold(a)  # type: ignore[operator]
    del a
    b = cache.take(MIB // 8, np.float64)
    assert _address(b) != where  # still referenced through ``kept``
    del kept
    c = cache.take(MIB // 8, np.float64)
    assert _address(c) == where and cache.reused == 1
    d = cache.take(MIB // 4, np.float32)  # same bytes, other dtype: the only idle one is none (b, c live)
    assert _address(d) not in (where, _address(b))
    where_b = _address(b)
    del b
    e = cache.take(MIB // 4, np.float32)
    assert _address(e) == where_b and e.dtype == np.float32 and e.shape == (MIB // 4,)
    assert c.base is not None and d.base is not None  # results are views of cached owners


def test_cache_leaves_small_results_alone_and_can_be_off() -> None:
    cache = ResultCache(idle_limit=64 * MIB)
    small = cache.take(100, np.float64)
    assert cache.held_bytes == 0 and small.shape == (100,)
    off = ResultCache(idle_limit=0)
    x = off.take(MIB, np.uint8)
    assert off.held_bytes == 0 and x.nbytes == MIB


def test_cache_releases_idle_buffers_beyond_its_limits() -> None:
    cache = ResultCache(idle_limit=3 * MIB, max_buffers=4)
    for size in (1, 2, 3, 4, 5):  # each dropped at once: idle
        cache.take(size * MIB, np.uint8)
    # taking 4 MiB left 3 + 4 (1 and 2 over the limit went); taking 5 left only 5 (3 and 4 went)
    assert cache.held_bytes == 5 * MIB
    live = [cache.take(MIB * 7 + i, np.uint8) for i in range(6)]  # all in use: the first 4 tracked
    assert cache.held_bytes == sum(MIB * 7 + i for i in range(4))
    assert all(x.nbytes == MIB * 7 + i for i, x in enumerate(live))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 9),
    st.sampled_from([1, 7, 4 * _BLOCK_ELEMS + 3]),  # the last one takes the blocked path
    st.sampled_from(["sum", "avg", "max", "min"]),
    st.sampled_from(["float32", "float64", "int64"]),
    st.integers(0, 2**32 - 1),
)
def test_reduce_rows_is_reduce_arrays_bit_for_bit(n: int, size: int, op: str, dtype: str, seed: int) -> None:
    """The ordered collectives reduce received rows with ``reduce_rows``; the simulator reduces
    member buffers with ``reduce_arrays``: the same chain of operations, element by element."""
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        rows = rng.integers(-1000, 1000, size=(n, size))
    else:
        # Wide magnitudes, so that any other association order would change the rounding.
        rows = (rng.standard_normal((n, size)) * 10.0 ** rng.integers(-8, 8, size=(n, size))).astype(dtype)
        rows.reshape(-1)[rng.integers(rows.size)] = np.nan
    want = reduce_arrays([rows[k].copy() for k in range(n)], op)
    got = reduce_rows(rows, op)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    # The data columns of rows that carry a trailer (the agreement check's gathered buffers).
    with_trailer = np.zeros((n, size + 4), dtype=rows.dtype)
    with_trailer[:, :size] = rows
    assert reduce_rows(with_trailer[:, :size], op).tobytes() == want.tobytes()
    # Both share fold_into; the definition itself, written out, is the independent oracle.
    combine = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}[op]
    chain = rows[0].copy()
    for k in range(1, n):
        chain = combine(chain, rows[k])
    if op == "avg":
        chain = chain // n if dtype == "int64" else chain / chain.dtype.type(n)
    assert want.tobytes() == chain.astype(want.dtype).tobytes()
    # Into a slice of a larger buffer (an all-reduce's own range), and from a lazy sequence
    # (the MPI transport folds pieces as they arrive): the same bytes, nothing else written.
    buffer = np.full(size + 2, 7, dtype=rows.dtype)
    assert reduce_rows(rows, op, out=buffer[1:-1]) is not None
    assert buffer[1:-1].tobytes() == want.tobytes() and buffer[0] == buffer[-1] == 7
    lazy = np.empty(size, dtype=rows.dtype)
    fold_into(lazy, (rows[k] for k in range(n)), op, n)
    assert lazy.tobytes() == want.tobytes()


class _SlowRequest:
    """An exit notice that takes ``delay`` seconds to be delivered (a peer slow to progress MPI)."""

    def __init__(self, delay: float) -> None:
        self.done_at = time.monotonic() + delay

    def Test(self) -> bool:
        return time.monotonic() >= self.done_at


class _Status:
    source = count = 0

    def Get_source(self) -> int:
        return self.source

    def Get_count(self, datatype: object) -> int:
        return self.count


class _FakeMPI:
    THREAD_MULTIPLE = 3
    BYTE = "byte"
    ANY_SOURCE = -1

    def Query_thread(self) -> int:
        return self.THREAD_MULTIPLE

    def Status(self) -> _Status:
        return _Status()


class _FakeComm:
    """Peers 1 and 2 have exited (their notices wait to be received); ours to them are slow."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.sent: list[int] = []
        self.inbox = [
            (peer, json.dumps({"kind": "exited", "op": "exit", "group": [peer], "seq": 0}).encode()) for peer in (1, 2)
        ]

    def Isend(self, buf: object, dest: int, tag: int) -> _SlowRequest:
        self.sent.append(dest)
        return _SlowRequest(self.delay)

    def Iprobe(self, source: int, tag: int, status: _Status) -> bool:
        if not self.inbox:
            return False
        status.source, status.count = self.inbox[0][0], len(self.inbox[0][1])
        return True

    def Recv(self, buf: list[bytearray], source: int, tag: int) -> None:
        peer, payload = self.inbox.pop(0)
        assert peer == source
        buf[0][:] = payload


def test_a_finished_rank_leaves_only_once_its_exit_notices_are_delivered() -> None:
    """Every peer has said "exited", but our notice to them is still in flight: leaving for
    MPI_Finalize now could lose it and keep that peer waiting for it until MPIPAR_TIMEOUT."""
    watchdog = Watchdog(_FakeMPI(), rank=0, size=3, timeout=30.0, abort=lambda: None)
    comm = _FakeComm(delay=1.5)
    watchdog.comm = comm
    start = time.monotonic()
    watchdog.announce_exit()
    assert comm.sent == [1, 2] and comm.inbox == []
    assert time.monotonic() - start >= 1.5 and watchdog._sends == []


def test_exited_is_a_ranks_last_word_sent_and_heard() -> None:
    """The watchdog thread may report a wait that ended just before the exit after the rank said
    "exited": it must not go out, and a peer must not let it undo "exited"."""
    watchdog = Watchdog(_FakeMPI(), rank=0, size=3, timeout=30.0, abort=lambda: None)
    comm = _FakeComm(delay=0.0)
    comm.inbox = []
    watchdog.comm = comm
    watchdog._notify("waiting", Waiting("all_reduce", (0, 1, 2), 7))
    watchdog._notify("exited", Waiting("exit", (0,), 0))
    watchdog._notify("waiting", Waiting("all_reduce", (0, 1, 2), 8))  # the thread, late
    assert comm.sent == [1, 2, 1, 2]
    late = {"kind": "waiting", "op": "all_reduce", "group": [0, 1, 2], "seq": 9}
    comm.inbox = [
        (1, json.dumps({"kind": "exited", "op": "exit", "group": [1], "seq": 0}).encode()),
        (1, json.dumps(late).encode()),
        (2, json.dumps(late).encode()),
    ]
    watchdog._drain()
    assert watchdog._has_exited(1) and not watchdog._has_exited(2)


def test_exited_goes_to_peers_that_finished_first() -> None:
    """A peer that finished first waits in announce_exit for every rank's "exited": skipping it
    because its own "exited" was heard would keep it waiting until MPIPAR_TIMEOUT."""
    watchdog = Watchdog(_FakeMPI(), rank=0, size=3, timeout=30.0, abort=lambda: None)
    comm = _FakeComm(delay=0.0)
    comm.inbox = [(2, json.dumps({"kind": "exited", "op": "exit", "group": [2], "seq": 0}).encode())]
    watchdog.comm = comm
    watchdog._drain()
    watchdog._notify("waiting", Waiting("all_reduce", (0, 1, 2), 7))  # a finished peer needs no "waiting"
    assert comm.sent == [1]
    watchdog._notify("exited", Waiting("exit", (0,), 0))
    assert comm.sent == [1, 1, 2]


def test_a_peer_that_never_finishes_is_named_and_the_rank_leaves_at_the_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    watchdog = Watchdog(_FakeMPI(), rank=0, size=3, timeout=0.3, abort=lambda: None)
    comm = _FakeComm(delay=0.0)
    comm.inbox = comm.inbox[:1]  # rank 1 finished; rank 2 never says so
    watchdog.comm = comm
    start = time.monotonic()
    watchdog.announce_exit()
    assert 0.3 <= time.monotonic() - start < 5
    assert (
        "mpipar: rank 0 finished, but rank(s) [2] did not finish within MPIPAR_TIMEOUT=0.3 s" in capsys.readouterr().err
    )
