"""The MPI backend: one process per rank, NumPy shards, mpi4py buffer methods.

    mpiexec -n 8 python examples/basics/reshard.py          # chosen automatically under mpiexec
    MPIPAR_BACKEND=mpi mpiexec -n 8 python train.py       # forced (e.g. on a GPU machine)

* ``MPIBackend``: this process hosts exactly one rank, ``MPI.COMM_WORLD``'s; a mesh's hosted
  ranks are ``(rank,)`` when the mesh contains it, ``()`` otherwise.
* ``MPICommunicator``: the collectives of ``mpipar.runtime.ordered`` (reductions local and
  in group order, so results are bit-identical to the simulator's) over mpi4py *buffer*
  calls (``Alltoall(v)``, ``Allgather(v)``, ``Gatherv``, ``Bcast``, ``Barrier``, and
  ``Isend``/``Irecv`` for reduce-scatters that fold pieces as they arrive); never the
  pickle-based lowercase methods.

Design choices
--------------
* **Native sums** (``MPIPAR_REDUCE=native``): floating-point sum / avg reductions call
  ``Allreduce``, ``Reduce_scatter(_block)`` and ``Reduce`` with ``MPI.SUM`` instead of
  the ordered path: one pass fewer over the data, but MPI's summation order, so results
  match the simulator to rounding, not bit for bit. Integer sums, max and min stay ordered
  (their result does not depend on the order, and NumPy's NaN rules hold).
* **Blocking calls**: mpi4py releases the GIL inside every blocking MPI call, so the fault
  watchdog's thread runs during a blocking collective just as during a ``Wait``; one call
  instead of two is the simpler path, and ``benchmarks/mpi_transport_choices.py`` times it
  against the non-blocking call plus ``Wait`` (figures in ``benchmarks/RESULTS.md``).
* **Reduce-scatter as the pieces arrive** (``MPICommunicator._scatter_reduce``, the first
  half of every ordered all-reduce too): from 512 KiB sent per member up, every receive and
  send of the pieces is posted at once on the group's communicator, and the pieces are
  waited for in group order and folded into the result one by one. The sum of the pieces
  already here overlaps the transfer of the rest, and each piece is read while still in
  cache. Against an all-to-all into a scratch buffer followed by one pass over it, this is
  faster from about 512 KiB up, while below it the single all-to-all call costs less
  (``benchmarks/mpi_transport_choices.py`` times both). An all-reduce reduces its range straight into its place in the result
  and then all-gathers in place (``MPI_IN_PLACE``).
* **All-gathers as one round of messages** (``MPICommunicator._gather_p2p``): from 256 KiB of
  result up, every piece's ``Isend``/``Irecv`` is posted at once on the group's communicator
  and waited for once, instead of MPICH's multi-step ``Allgather`` (each step a rendezvous of
  every member, costly where ranks share cores); the ordered all-reduce's second half too.
* **Started all-reduces** (``all_reduce_start``, for ``dist.overlap_grad_reduction``): the
  ordered algorithm in non-blocking calls (the ranges as one round of ``Isend``/``Irecv``, or
  ``Iallgather`` when small; then, once ``test`` or ``wait`` finds them complete, the local
  reduction and one round of messages with the reduced ranges), on two duplicates of the
  group's communicator, one per phase, so each sees its calls in start order on every member
  whatever the timing (``_StartedAllReduce``).
* **Sub-communicators**: one per rank group, created on first use with
  ``MPI_Comm_create_group`` (collective over the group's members only, so ranks outside
  the group are not involved) and cached; member ``i`` of the group is rank ``i`` of its
  communicator, so group order is member order.
* **Uneven buffers**: the v-variants with exact per-member counts, pieces packed back to
  back; no padding is ever sent. Where every member's piece has the same size, and every
  member knows it (all_gather, the reductions' exchanges), the plain call is used instead
  (MPICH runs it faster); a general all_to_all cannot know that its peers' counts are
  equal. Data moves typed where MPI has the dtype (float32/64, int32/64) and as
  ``MPI.BYTE`` otherwise, after an explicit cast of every buffer to the tensor's dtype, so
  any NumPy dtype (bool, float16, complex) works; no MPI reduction op is
  involved except in native mode (above), and only for float32/64 and complex sums.
* **Point to point**: ``exchange`` posts every ``Isend``/``Irecv`` of a transfer batch and
  waits for all (tags per pair come from the plan), on a private duplicate of
  ``COMM_WORLD``. ``send`` is an ``Isend`` whose request and buffer are kept until it
  completes (checked at every later call, waited for at exit), so a ``send`` never blocks
  on a ``recv`` posted later; ``recv`` waits for its message on a second duplicate.
  Received sizes are checked against the expected shape.
* **Faults**: every wait runs under ``mpipar.runtime.faults.Watchdog`` (``MPIPAR_TIMEOUT``,
  arrival notices), an uncaught exception aborts the job, ``MPIPAR_CHECK_COLLECTIVES=1``
  compares signatures on a duplicate of each group's communicator.
* **Output**: rank N > 0 prefixes its lines with ``[rank N] `` (``mpipar.runtime.log``).
* **Measured timelines** (``MPIPAR_TRACE``, ``mpipar.debug.measured``): ``trace_origin``
  aligns the ranks' clocks with a barrier, ``gather_at_root`` brings every rank's span
  records to rank 0 at exit (``Gatherv`` of plain arrays), both on a private duplicate of
  ``COMM_WORLD``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpipar import _threads
from mpipar.backend import Backend
from mpipar.comm import (
    REDUCE_OPS,
    Array,
    Completed,
    Group,
    Pending,
    PointToPoint,
    Shape,
    fold_into,
    recording,
    reduce_arrays,
    reduce_rows,
)
from mpipar.mesh import ProcessMesh
from mpipar.runtime import heartbeat
from mpipar.runtime.agreement import TRAILER_BYTES, ring_problem, signature_words, trailer_elements
from mpipar.runtime.faults import (
    CollectiveMismatchError,
    Watchdog,
    agree_from_env,
    check_from_env,
    compare_signatures,
    install_excepthook,
    report_mismatch_once,
    timeout_from_env,
)
from mpipar.runtime.hosts import format_map, rank_hosts, warn_if_spans_hosts
from mpipar.runtime.log import flush_std_streams, install_rank_prefix
from mpipar.runtime.ordered import OrderedCommunicator, _layout, _starts, reduce_mode_from_env
from mpipar.runtime.sentinel import StderrSentinel
from mpipar.runtime.sentinel import enabled as sentinel_enabled
from mpipar.spec import chunk_range

ABORT_FLUSH_S = 0.3
FOLD_AS_ARRIVING_MIN_BYTES = 512 * 1024
"""Reduce-scatters where each member sends at least this many bytes reduce each piece as it
arrives (point to point) instead of after one all-to-all (``MPICommunicator._scatter_reduce``)."""
FOLD_TAG = 0x6D70
"""The tag of those point-to-point pieces, on the group's own communicator (where no other
point-to-point traffic runs; collectives there have a context of their own)."""
GATHER_P2P_MIN_BYTES = 256 * 1024
"""All-gathers whose result has at least this many bytes post every piece's send and receive
at once (``MPICommunicator._gather_p2p``) instead of calling ``Allgather(v)``."""
GATHER_TAG = 0x6D71
STARTED_TAG = 0x6D72
"""The tag of a started all-reduce's messages, on the group's started communicators."""
AGREE_TAG = 0x6D73
"""The tag of a collective's signature message to its ring successor (``agreement``), on the
group's own communicator (or the started one), posted in call order on every member."""


_SETTINGS_BYTES = 256


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, as the uint8 view MPI.BYTE buffers take."""
    return a.reshape(-1).view(np.uint8)


_MOVE_TYPES = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
}
"""Dtypes whose buffers go to MPI as they are, typed: the call then needs no byte views and
no counts (it reads them off the buffers), a few microseconds less Python per collective.
Any other dtype travels as bytes."""


def _spec(a: np.ndarray) -> list[Any]:
    """A whole contiguous buffer as an mpi4py buffer spec (typed where ``_MOVE_TYPES`` has
    its dtype, else bytes)."""
    kind = _MOVE_TYPES.get(a.dtype)
    return [a, kind] if kind is not None else [_bytes(a), MPI.BYTE]


_NATIVE_SUM_TYPES = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
"""The dtypes ``MPIPAR_REDUCE=native`` sums with MPI (others take the ordered path)."""


def _averaged(total: np.ndarray, op: str, members: int) -> np.ndarray:
    """A native sum, divided for ``avg`` as ``reduce_arrays`` does (floats only here)."""
    if op == "avg":
        total /= total.dtype.type(members)
    return total


def _uniform(counts: Sequence[int]) -> bool:
    """Do all members send (or receive) the same number of elements?"""
    return counts.count(counts[0]) == len(counts)


def _byte_counts(counts: Sequence[int], itemsize: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements of pieces of these element counts, packed back to back."""
    return [int(c) * itemsize for c in counts], [s * itemsize for s in _starts(tuple(counts))[:-1]]


class MPIRuntime:
    """Process-wide MPI state: world, private communicators, group cache, watchdog, hooks.

    Created once, by the first ``MPIBackend``; every rank of the job must create it (every
    rank runs the same script, and the first mesh it builds starts the backend).
    """

    def __init__(self) -> None:
        self.world = MPI.COMM_WORLD
        self.rank = self.world.Get_rank()
        self.size = self.world.Get_size()
        install_rank_prefix(self.rank)
        install_excepthook(self.abort, self.rank)
        self.sentinel = StderrSentinel()
        if sentinel_enabled():
            self.sentinel.start(self.rank)
        _threads.limit_loaded_blas()
        self.timeout = timeout_from_env()
        self.check = check_from_env()
        self.agree = agree_from_env()
        self.reduce_mode = reduce_mode_from_env()
        self.watchdog = Watchdog(MPI, self.rank, self.size, self.timeout, self.abort)
        self.world_group = self.world.Get_group()
        with self.watchdog.watch("start of the MPI backend (MPI_Comm_dup)", tuple(range(self.size)), 0):
            self.watchdog.comm = self.world.Dup()
            self.p2p = self.world.Dup()
            self.mailbox = self.world.Dup()
        self._comms: dict[Group, Any] = {}
        self._side: dict[Group, Any] = {}
        self._started: dict[Group, tuple[Any, Any]] = {}
        self._trace_comm: Any = None
        self._compare_settings()
        self.communicator = MPICommunicator(self)
        atexit.register(self._at_exit)
        self.hosts = rank_hosts(self.size)
        # After the excepthook and the exit handler: the heartbeat records an error before the
        # abort and its "exited" before the exit handler waits for the other ranks.
        heartbeat.start_from_env(self.rank, self.size, self.watchdog.progress)
        if self.rank == 0 and self.hosts is not None:  # the job header: where the launcher put each rank
            print(f"mpipar: {self.size} ranks on {'; '.join(format_map(self.hosts))}", file=sys.stderr, flush=True)

    def _compare_settings(self) -> None:
        """Settings every rank must share, compared once at start-up (one small all-gather of
        the world): a job where one rank checks signatures and another does not, or where the
        timeouts differ, would fail later in ways that hide the cause."""
        if self.size == 1:
            return
        mine = {
            "MPIPAR_CHECK_COLLECTIVES": int(self.check),
            "MPIPAR_AGREE": int(self.agree),
            "MPIPAR_TIMEOUT": self.timeout,
            "MPIPAR_REDUCE": self.reduce_mode,
        }
        payload = np.frombuffer(json.dumps(mine, sort_keys=True).encode().ljust(_SETTINGS_BYTES), dtype=np.uint8)
        if payload.size > _SETTINGS_BYTES:
            raise ValueError(f"mpipar settings too long to compare across ranks: {mine}")
        everyone = np.empty((self.size, _SETTINGS_BYTES), dtype=np.uint8)
        with self.watchdog.watch("comparing settings at start-up", tuple(range(self.size)), 0):
            self.world.Allgather([payload, MPI.BYTE], [everyone, MPI.BYTE])
        for r in range(self.size):
            theirs = json.loads(everyone[r].tobytes().decode().rstrip())
            differ = {k: (mine[k], theirs.get(k)) for k in mine if theirs.get(k) != mine[k]}
            if differ:
                detail = "; ".join(
                    f"{k}: rank {self.rank} has {a!r}, rank {r} has {b!r}" for k, (a, b) in differ.items()
                )
                raise ValueError(
                    f"mpipar settings differ between ranks ({detail}); every rank must run with the same "
                    "MPIPAR_CHECK_COLLECTIVES, MPIPAR_AGREE, MPIPAR_TIMEOUT and MPIPAR_REDUCE (set them for the "
                    "whole job, e.g. mpiexec -genv NAME VALUE)"
                )

    def abort(self) -> None:
        flush_std_streams()
        # MPI_Abort makes hydra kill every rank at once; give its proxies a moment to forward
        # the last lines (the traceback, the timeout report) first, or they may be lost.
        time.sleep(ABORT_FLUSH_S)
        self.world.Abort(1)

    def comm_for(self, group: Group) -> Any:
        """The cached communicator of ``group`` (member i = its rank i)."""
        comm = self._comms.get(group)
        if comm is None:
            with self.watchdog.watch("creating the group's communicator", group, 0):
                comm = self.world.Create_group(self.world_group.Incl(list(group)))
            # Errors come back as exceptions (not MPICH's fatal abort), so the watchdog's
            # context can name the collective and point at check mode (CollectiveDesyncError).
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            self._comms[group] = comm
        return comm

    def started_for(self, group: Group) -> tuple[Any, Any]:
        """Two duplicates of the group's communicator for started all-reduces: the first carries
        their first phase (the all-to-all, or the whole gather), the second their all-gather.
        Each phase is posted in start order on every member, so each communicator sees its
        collectives in one order everywhere, whatever the timing of the other phase."""
        comms = self._started.get(group)
        if comms is None:
            base = self.comm_for(group)
            with self.watchdog.watch("creating the group's communicators for started all-reduces", group, 0):
                comms = (base.Dup(), base.Dup())
            self._started[group] = comms
        return comms

    def side_for(self, group: Group) -> Any:
        """A duplicate of the group's communicator for check-mode signatures."""
        comm = self._side.get(group)
        if comm is None:
            base = self.comm_for(group)
            with self.watchdog.watch("creating the group's check communicator", group, 0):
                comm = base.Dup()
            self._side[group] = comm
        return comm

    def trace_comm(self) -> Any:
        """A private duplicate of the world for measured timelines (collective on first use)."""
        if self._trace_comm is None:
            with self.watchdog.watch("start of the measured timeline (MPI_Comm_dup)", tuple(range(self.size)), 0):
                self._trace_comm = self.world.Dup()
        return self._trace_comm

    def trace_origin(self) -> float:
        """``time.perf_counter()`` read right after a barrier of the whole world (collective)."""
        comm = self.trace_comm()
        with self.watchdog.watch("the barrier that starts the measured timeline", tuple(range(self.size)), 0):
            comm.Ibarrier().Wait()
        return time.perf_counter()

    def gather_at_root(self, arrays: Sequence[np.ndarray]) -> list[list[np.ndarray]] | None:
        """Every rank's ``arrays`` on rank 0, in rank order (None on the others); a collective.

        Each rank passes the same number of 1-d arrays with the same dtypes, of any lengths;
        they move as bytes with ``Gatherv`` (exact counts, no pickle).
        """
        comm = self.trace_comm()
        root = self.rank == 0
        flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        sizes = np.array([a.nbytes for a in flat], dtype=np.int64)
        table = np.empty((self.size, len(flat)), dtype=np.int64) if root else None
        received: list[np.ndarray] = []
        with self.watchdog.watch("gathering the measured timeline at rank 0", tuple(range(self.size)), 0):
            comm.Igather([sizes, MPI.BYTE], [table, MPI.BYTE] if root else None, root=0).Wait()
            for j, a in enumerate(flat):
                if root:
                    assert table is not None
                    counts, displs = _byte_counts(table[:, j].tolist(), 1)
                    buf = np.empty(sum(counts), dtype=np.uint8)
                    comm.Igatherv([_bytes(a), MPI.BYTE], [buf, (counts, displs), MPI.BYTE], root=0).Wait()
                    received.append(buf)
                else:
                    comm.Igatherv([_bytes(a), MPI.BYTE], None, root=0).Wait()
        if not root:
            return None
        assert table is not None
        out: list[list[np.ndarray]] = []
        starts = np.zeros(len(flat), dtype=np.int64)
        for r in range(self.size):
            row = []
            for j, a in enumerate(flat):
                size = int(table[r, j])
                row.append(received[j][starts[j] : starts[j] + size].view(a.dtype).copy())
                starts[j] += size
            out.append(row)
        return out

    def _at_exit(self) -> None:
        flush_std_streams()
        self.communicator.wait_pending_sends()
        with contextlib.suppress(Exception):  # peers may be gone already; exiting must not fail
            self.watchdog.announce_exit()
        flush_std_streams()


_runtime: MPIRuntime | None = None


def runtime() -> MPIRuntime:
    global _runtime
    if _runtime is None:
        _runtime = MPIRuntime()
    return _runtime


class _BoundAllReduce:
    """``MPICommunicator.bound_all_reduce``'s call (a class: its facts bound once, no closure cells)."""

    __slots__ = (
        "comm",
        "data",
        "dtype",
        "group",
        "group_word",
        "kind",
        "label",
        "mpi_comm",
        "op",
        "parts",
        "recv",
        "rows",
        "send",
        "shape",
        "size",
        "words",
    )

    def __init__(self, comm: MPICommunicator, group: Group, shape: Shape, dtype: np.dtype, op: str) -> None:
        self.comm, self.group, self.shape, self.dtype, self.op = comm, group, shape, dtype, op
        self.kind = _MOVE_TYPES[dtype]
        self.size = size = math.prod(shape)
        extra = trailer_elements(dtype) if comm.agree else None
        width = size + (extra or 0)
        # The gathered rows live only until the fold has read them, so one buffer serves every step.
        self.rows = np.empty((len(group), width), dtype=dtype)
        self.data = self.rows[:, :size] if extra else self.rows
        self.recv = [self.rows, self.kind]
        # With the agreement check, each step's buffer goes out with the call's signature as
        # its trailer (``agreement``): the first three words are fixed, the last numbers the call.
        # ``words`` is that trailer itself (a view of the send buffer): each call writes its
        # number there, and nothing else.
        self.send = np.empty(width, dtype=dtype) if extra else None
        self.words = None
        if self.send is not None:
            self.words = self.send[size:].view(np.uint64)
            self.words[:] = signature_words("all_reduce", dtype, op, {"shape": shape}, group, 0)
        self.group_word = int(self.words[3]) & ~0xFFFFFFFF if self.words is not None else 0
        self.label = f"all_reduce({op})"
        self.parts = {"shape": shape}  # (a mismatch report's facts: made once, read only)
        self.mpi_comm = comm._rt.comm_for(group)

    def __call__(self, a: Array) -> Array:
        c = self.comm
        if recording() or c.check_collectives or a.shape != self.shape or a.dtype != self.dtype:
            # Observers hear the call with its facts; anything unexpected takes the checked path.
            return c.all_reduce(self.group, {c.rank: a}, self.op)[c.rank]
        flat = a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)
        group = self.group
        seq = c._number(group, "all_reduce", dtype=self.dtype, reduce_type=self.op)
        send, words = self.send, self.words
        if send is not None and words is not None:
            send[: self.size] = flat
            words[3] = self.group_word | (seq & 0xFFFFFFFF)  # (in the send buffer's trailer)
            flat = send
        with c._watch(self.label, group, seq):
            if c._pending:
                c._reap()
            self.mpi_comm.Allgather([flat, self.kind], self.recv)
        if words is not None:
            c._check_rows(group, self.rows, self.size, words, ("all_reduce", self.dtype, self.op, self.parts, seq))
        return reduce_rows(self.data, self.op, np).reshape(self.shape)


EAGER_BOUND_MAX = 16
"""Eager all-reduce signatures kept bound (``MPICommunicator._all_reduce``): a step makes a few;
a program with more pays the general path for the rest."""
_UNBOUND: Any = object()


class MPICommunicator(OrderedCommunicator):
    """mpi4py transport for the ordered collectives, plus point-to-point (module docstring)."""

    name = "mpi"

    def __init__(self, rt: MPIRuntime) -> None:
        super().__init__()
        self._rt = rt
        self.rank = rt.rank
        self.check_collectives = rt.check
        self.agree = rt.agree
        self._pending: list[tuple[Any, np.ndarray, int, int]] = []
        self._exchanges = 0
        self.native_sums = rt.reduce_mode == "native"
        self.fold_min_bytes = FOLD_AS_ARRIVING_MIN_BYTES
        self.bind_eager_all_reduces = True
        """Whether eager all-reduces take the bound path (``_all_reduce``); off, every call takes
        the general one (tests compare the two)."""
        self._eager_bound: dict[tuple[Any, ...], Callable[[Array], Array] | None] = {}
        """Eager all-reduces that take a captured program's bound path, per (group, shape,
        dtype, op and the settings that choose the path); None where that path does not apply
        (``_all_reduce``)."""

    # ------------------------------------------------------------------ MPIPAR_REDUCE=native
    def _native_type(self, dtype: np.dtype, op: str, group: Group) -> Any | None:
        """The MPI datatype to sum ``dtype`` with natively, or None for the ordered path.

        Only floating-point sums (and averages, a sum then a division) go to MPI: integer sums
        are exact in any order and max / min do not depend on it, so the ordered path already
        gives MPI's answer there, with NumPy's NaN semantics that MPI's MAX/MIN do not promise.
        """
        if not self.native_sums or op not in ("sum", "avg") or len(group) == 1:
            return None
        return _NATIVE_SUM_TYPES.get(np.dtype(dtype))

    def _all_reduce(self, group: Group, bufs: Any, op: str) -> dict[int, Array]:
        a = self._mine("all_reduce", group, bufs)
        # A small all-reduce (one gather, then the fold) made again and again, as every eager
        # step's are: the bound path captured programs use, which does the same call (numbered,
        # watched, its signature as the trailer, folded in group order: the same bits) with
        # the receive buffer and signature words kept from call to call. Anything it does not
        # cover goes on below: ``bound_all_reduce`` says None, or the bound call itself falls
        # back to the checked path (observers, check mode), so neither is taken here: that
        # fallback calls ``all_reduce``, which would come back to this line.
        if type(a) is np.ndarray and self.bind_eager_all_reduces and not self.check_collectives and not recording():
            # (with the settings that choose the path, which a program may change between calls)
            key = (group, a.shape, a.dtype, op, self.native_sums, self.small_reduce_bytes, self.agree)
            bound = self._eager_bound.get(key, _UNBOUND)
            if bound is _UNBOUND:
                bound = self.bound_all_reduce(group, a.shape, a.dtype, op)
                if len(self._eager_bound) < EAGER_BOUND_MAX:  # (each holds gather buffers up to 256 KiB)
                    self._eager_bound[key] = bound
            if bound is not None:
                return {self.rank: bound(a)}
        mpi_type = self._native_type(a.dtype, op, group)
        if mpi_type is None:
            return super()._all_reduce(group, bufs, op)
        return self._native_reduce_to(group, a, op, mpi_type, root=None)

    def _reduce(self, group: Group, bufs: Any, op: str, root: int) -> dict[int, Array]:
        a = self._mine("reduce", group, bufs)
        mpi_type = self._native_type(a.dtype, op, group)
        if mpi_type is None:
            return super()._reduce(group, bufs, op, root)
        return self._native_reduce_to(group, a, op, mpi_type, root=root)

    def _native_reduce_to(self, group: Group, a: Array, op: str, mpi_type: Any, root: int | None) -> dict[int, Array]:
        """MPI's own sum of every member's ``a``: on all members, or on rank ``root``."""
        flat, shape = self._flat(a, a.dtype), tuple(a.shape)
        gets_result = root is None or self.rank == root
        out = self._result(flat.size, a.dtype) if gets_result else None
        name, facts = ("all_reduce", {}) if root is None else ("reduce", {"root": root})
        # (``trailer`` stays False: a native sum cannot carry bits, its signature takes the ring)
        with self._collective(group, name, dtype=a.dtype, reduce_type=op, trailer=False, shape=shape, **facts):
            self._reap()
            comm = self._rt.comm_for(group)
            if root is None:
                comm.Allreduce([flat, mpi_type], [out, mpi_type], op=MPI.SUM)
            else:
                receive = [out, mpi_type] if out is not None else None
                comm.Reduce([flat, mpi_type], receive, op=MPI.SUM, root=group.index(root))
        return {self.rank: _averaged(out, op, len(group)).reshape(shape)} if out is not None else {}

    def _reduce_scatter(self, group: Group, chunks: Any, op: str) -> dict[int, Array]:
        row = self._mine("reduce_scatter", group, chunks)
        mpi_type = self._native_type(row[0].dtype, op, group) if len(row) == len(group) else None
        if mpi_type is None:  # (a wrong chunk count is reported by the ordered path)
            return super()._reduce_scatter(group, chunks, op)
        dtype = row[0].dtype
        shapes = tuple(c.shape for c in row)
        counts, _, same = _layout(shapes)
        mine = group.index(self.rank)
        out = self._result(counts[mine], dtype)
        with self._collective(group, "reduce_scatter", dtype=dtype, reduce_type=op, shapes=shapes):
            send = self._pack(row, dtype)
            self._reap()
            comm = self._rt.comm_for(group)
            if same:
                comm.Reduce_scatter_block([send, mpi_type], [out, mpi_type], op=MPI.SUM)
            else:
                comm.Reduce_scatter([send, mpi_type], [out, mpi_type], counts, op=MPI.SUM)
        return {self.rank: _averaged(out, op, len(group)).reshape(shapes[mine])}

    # ------------------------------------------------------------------ a captured program's all-reduce
    def bound_all_reduce(self, group: Group, shape: Shape, dtype: Any, op: str) -> Callable[[Array], Array] | None:
        """``all_reduce`` of one buffer of ``shape`` and ``dtype`` on ``group``, pre-bound for a
        captured program (``mpipar.capture``), which calls it every step with the same facts.

        The trace has already checked what ``all_reduce`` checks per call (this rank's buffer,
        the op, the group), so the bound call does only the call's work: number it on its
        group, gather every member's whole buffer with one ``Allgather`` into a receive buffer
        kept from step to step, and fold the rows in group order (``reduce_rows``, the same
        arithmetic as the general path, so the same bits). None where the general path does
        something else: native sums, the split (reduce-scatter + all-gather) path, the
        point-to-point gather, check mode, or a dtype moved as bytes.
        """
        group = tuple(group)
        dtype = np.dtype(dtype)
        size = math.prod(shape)
        n = len(group)
        if (
            n == 1
            or self.rank not in group
            or self.check_collectives
            or self._native_type(dtype, op, group) is not None
            or dtype not in _MOVE_TYPES
            or op not in REDUCE_OPS
            or not size
            or not self.gathers_whole(size, n, dtype.itemsize)
            # as the general path decides between Allgather and the point-to-point gather
            or n
            * (size + ((trailer_elements(dtype) or 0) if self._uses_trailer(size, n, dtype) else 0))
            * dtype.itemsize
            >= GATHER_P2P_MIN_BYTES
        ):
            return None
        return _BoundAllReduce(self, group, tuple(shape), dtype, op)

    # ------------------------------------------------------------------ started all-reduce
    def _all_reduce_start(self, group: Group, bufs: Any, op: str) -> Pending:
        a = self._mine("all_reduce", group, bufs)
        if len(group) == 1:
            return Completed({self.rank: reduce_arrays([a], op, np)})
        seq = self._number(group, "all_reduce", dtype=a.dtype, reduce_type=op, shape=tuple(a.shape))
        self._reap()
        return _StartedAllReduce(self, group, a, op, seq, self._native_type(a.dtype, op, group))

    # ------------------------------------------------------------------ ordered reductions
    def _scatter_reduce(
        self, group: Group, send: Array, counts: tuple[int, ...], same: bool, op: str, out: Array | None = None
    ) -> Array:
        """The ordered reduce-scatter of ``OrderedCommunicator._scatter_reduce``, reducing each
        piece as it arrives: every receive and send is posted at once, then the pieces are
        waited for in group order and folded in, so the sum of the pieces that are here
        overlaps the transfer of those still on their way, and each is read while it is still
        in cache. Small buffers keep the one-call all-to-all, whose fixed cost is lower (the
        module docstring has the measurements).
        """
        starts = _starts(counts)
        if starts[-1] * send.itemsize < self.fold_min_bytes:  # the same on every member: all choose alike
            return super()._scatter_reduce(group, send, counts, same, op, out)
        n, i = len(group), group.index(self.rank)
        mine = counts[i]
        if out is None:
            out = np.empty(mine, dtype=send.dtype)
        rows = self._scratch(n * mine, send.dtype).reshape(n, mine)
        self._reap()
        comm = self._rt.comm_for(group)
        receives = [comm.Irecv(_spec(rows[j]), j, FOLD_TAG) if j != i and mine else None for j in range(n)]
        sends = [
            comm.Isend(_spec(send[starts[j] : starts[j + 1]]), j, FOLD_TAG)
            for j in (*range(i + 1, n), *range(i))  # each member starts with its successor
            if counts[j]
        ]

        def arriving() -> Iterator[np.ndarray]:
            for j in range(n):
                if j == i:
                    yield send[starts[i] : starts[i + 1]]
                else:
                    if mine:
                        receives[j].Wait()
                    yield rows[j]

        fold_into(out, arriving(), op, n)
        MPI.Request.Waitall(sends)
        return out

    # ------------------------------------------------------------------ agreement
    def _ring_start(self, group: Group, words: np.ndarray, comm: Any = None) -> Any:
        n, i = len(group), group.index(self.rank)
        comm = self._rt.comm_for(group) if comm is None else comm
        theirs = np.empty(TRAILER_BYTES // 8, dtype=np.uint64)
        receive = comm.Irecv([theirs, MPI.UINT64_T], (i - 1) % n, AGREE_TAG)
        send = comm.Isend([words, MPI.UINT64_T], (i + 1) % n, AGREE_TAG)
        return [receive, send], theirs

    def _ring_test(self, handle: Any) -> np.ndarray | None:
        reqs, theirs = handle
        return theirs if reqs[0].Test() else None

    def _ring_wait(self, handle: Any, limit_s: float | None = None) -> np.ndarray | None:
        reqs, theirs = handle
        if limit_s is None:
            MPI.Request.Waitall(reqs)
            return theirs
        until = time.monotonic() + limit_s
        while not reqs[0].Test():
            if time.monotonic() > until:
                return None
            time.sleep(0.005)
        return theirs

    # ------------------------------------------------------------------ plumbing
    def _watch(self, op: str, group: Group, seq: int) -> contextlib.AbstractContextManager[Any]:
        return self._rt.watchdog.watch(op, group, seq)

    def _check(self, group: Group, seq: int, sig: dict[str, Any]) -> None:
        side = self._rt.side_for(group)
        payload = np.frombuffer(json.dumps(sig).encode(), dtype=np.uint8)
        lengths = np.zeros(len(group), dtype=np.int64)
        with self._watch(f"the check before {sig['label']}", group, seq):
            side.Iallgather(np.array([payload.size], dtype=np.int64), lengths).Wait()
            counts, displs = _byte_counts(lengths.tolist(), 1)
            everything = np.empty(sum(counts), dtype=np.uint8)
            side.Iallgatherv([payload, MPI.BYTE], [everything, (counts, displs), MPI.BYTE]).Wait()
        sigs = [json.loads(everything[d : d + c].tobytes()) for c, d in zip(counts, displs, strict=True)]
        problem = compare_signatures(group, sigs, seq)
        if problem:
            report_mismatch_once(group, self.rank, f"(reported by rank {self.rank}) {problem}")

    # ------------------------------------------------------------------ transport
    def _t_alltoallv(
        self, group: Group, send: Array, scounts: Sequence[int], recv: Array, rcounts: Sequence[int]
    ) -> None:
        self._reap()
        sc, sd = _byte_counts(scounts, send.itemsize)
        rc, rd = _byte_counts(rcounts, recv.itemsize)
        comm = self._rt.comm_for(group)
        comm.Alltoallv([_bytes(send), (sc, sd), MPI.BYTE], [_bytes(recv), (rc, rd), MPI.BYTE])

    def _t_alltoall(self, group: Group, send: Array, recv: Array, count: int) -> None:
        # The plain call, which MPICH runs faster than the v-variant (~10-20% at 4 MiB over
        # 8 ranks) and which needs no count arrays.
        self._reap()
        comm = self._rt.comm_for(group)
        if send.size == recv.size == count * len(group):  # whole buffers: MPI reads the counts off them
            comm.Alltoall(_spec(send), _spec(recv))
            return
        nbytes = int(count) * send.itemsize
        comm.Alltoall([_bytes(send), nbytes, MPI.BYTE], [_bytes(recv), nbytes, MPI.BYTE])

    def _gather_p2p(self, group: Group, send: Array | None, recv: Array, counts: Sequence[int]) -> None:
        """All-gather as one round of point-to-point messages: every receive and send posted at
        once on the group's communicator, then one wait (``send`` None: this member's piece is
        already in its place in ``recv``).

        MPICH's ``Allgather`` for large buffers is a ring or recursive doubling: n - 1 (or
        log n) steps, each a rendezvous of every member. Where ranks share cores, each step
        waits for every member to be scheduled; one round of messages waits once. Below
        256 KiB the two cost about the same (``benchmarks/runtime_collectives.py``).
        """
        n, i = len(group), group.index(self.rank)
        starts = _starts(tuple(counts))
        comm = self._rt.comm_for(group)
        own = recv[starts[i] : starts[i + 1]]
        if send is not None and own.size:
            own[...] = send
        reqs = [
            comm.Irecv(_spec(recv[starts[j] : starts[j + 1]]), j, GATHER_TAG)
            for j in (*range(i + 1, n), *range(i))
            if counts[j]
        ]
        if own.size:
            reqs += [comm.Isend(_spec(own), j, GATHER_TAG) for j in (*range(i + 1, n), *range(i))]
        MPI.Request.Waitall(reqs)

    def _t_allgatherv(self, group: Group, send: Array, recv: Array, counts: Sequence[int]) -> None:
        self._reap()
        if recv.nbytes >= GATHER_P2P_MIN_BYTES:  # every member has the same counts: all choose alike
            self._gather_p2p(group, send, recv, counts)
            return
        comm = self._rt.comm_for(group)
        if _uniform(counts):  # every member passes the same counts, so every member agrees
            if send.size == counts[0] and recv.size == counts[0] * len(group):
                comm.Allgather(_spec(send), _spec(recv))  # MPI reads the counts off the buffers
                return
            count = int(counts[0]) * recv.itemsize
            comm.Allgather([_bytes(send), count, MPI.BYTE], [_bytes(recv), count, MPI.BYTE])
            return
        rc, rd = _byte_counts(counts, recv.itemsize)
        comm.Allgatherv([_bytes(send), MPI.BYTE], [_bytes(recv), (rc, rd), MPI.BYTE])

    def _t_allgather_in_place(self, group: Group, recv: Array, counts: Sequence[int]) -> None:
        self._reap()
        if recv.nbytes >= GATHER_P2P_MIN_BYTES:
            self._gather_p2p(group, None, recv, counts)
            return
        comm = self._rt.comm_for(group)
        if _uniform(counts) and recv.size == counts[0] * len(group):
            comm.Allgather(MPI.IN_PLACE, _spec(recv))
            return
        rc, rd = _byte_counts(counts, recv.itemsize)
        comm.Allgatherv(MPI.IN_PLACE, [_bytes(recv), (rc, rd), MPI.BYTE])

    def _t_gatherv(self, group: Group, root: int, send: Array, recv: Array | None, counts: Sequence[int]) -> None:
        self._reap()
        comm = self._rt.comm_for(group)
        if recv is None:
            comm.Gatherv([_bytes(send), MPI.BYTE], None, root=root)
            return
        rc, rd = _byte_counts(counts, recv.itemsize)
        comm.Gatherv([_bytes(send), MPI.BYTE], [_bytes(recv), (rc, rd), MPI.BYTE], root=root)

    def _t_bcast(self, group: Group, buf: Array, root: int) -> None:
        self._reap()
        self._rt.comm_for(group).Bcast([_bytes(buf), MPI.BYTE], root=root)

    def _t_barrier(self, group: Group) -> None:
        self._reap()
        self._rt.comm_for(group).Barrier()

    # ------------------------------------------------------------------ point to point
    def _exchange(self, transfers: Sequence[PointToPoint], hosted: set[int]) -> dict[tuple[int, int, int], Array]:
        self._reap()
        comm = self._rt.p2p
        requests: list[Any] = []
        keep: list[np.ndarray] = []
        received: list[tuple[PointToPoint, np.ndarray, int]] = []
        peers: set[int] = set()
        for t in transfers:
            if t.src == self.rank:
                if t.data is None or tuple(t.data.shape) != tuple(t.shape):
                    got = "no data" if t.data is None else f"shape {list(t.data.shape)}"
                    raise RuntimeError(
                        f"transfer {t.src} -> {t.dst} (tag {t.tag}): the sender has {got}, expected {list(t.shape)}"
                    )
                data = np.ascontiguousarray(t.data, dtype=t.dtype)
                keep.append(data)
                requests.append(comm.Isend([_bytes(data), MPI.BYTE], dest=t.dst, tag=t.tag))
                peers.add(t.dst)
            elif t.dst == self.rank:
                buf = self._result(math.prod(t.shape), t.dtype).reshape(t.shape)
                received.append((t, buf, len(requests)))
                requests.append(comm.Irecv([_bytes(buf), MPI.BYTE], source=t.src, tag=t.tag))
                peers.add(t.src)
        if not requests:
            return {}
        self._exchanges += 1
        statuses = [MPI.Status() for _ in requests]
        group = tuple(sorted(peers | {self.rank}))
        with self._rt.watchdog.watch(
            f"point-to-point exchange with ranks {sorted(peers)}", group, self._exchanges, p2p=True
        ):
            MPI.Request.Waitall(requests, statuses)
        out = {}
        for t, buf, index in received:
            _check_count(statuses[index], buf, t.src, t.dst, t.tag)
            out[(t.src, t.dst, t.tag)] = buf
        return out

    def _send(self, src: int, dst: int, buf: Array, tag: int) -> None:
        if src != self.rank:
            raise RuntimeError(f"rank {self.rank} cannot send on behalf of rank {src} (send {src} -> {dst})")
        self._reap()
        data = np.ascontiguousarray(buf)
        req = self._rt.mailbox.Isend([_bytes(data), MPI.BYTE], dest=dst, tag=tag)
        self._pending.append((req, data, dst, tag))

    def _recv(self, src: int, dst: int, shape: Shape, dtype: np.dtype, tag: int) -> Array:
        if dst != self.rank:
            raise RuntimeError(f"rank {self.rank} cannot receive on behalf of rank {dst} (recv {src} -> {dst})")
        buf = self._recv_buffer(shape, dtype)
        if type(buf) is not np.ndarray:  # the MPI wheel is not CUDA-aware: a device buffer would crash it
            raise TypeError(
                f"MPI receives into host (NumPy) memory; the buffer for the message from rank {src} "
                f"(tag {tag}) is a {type(buf).__module__}.{type(buf).__name__}"
            )
        self._reap()
        status = MPI.Status()
        req = self._rt.mailbox.Irecv([_bytes(buf), MPI.BYTE], source=src, tag=tag)
        with self._rt.watchdog.watch(
            f"recv of {dtype}{list(shape)} from rank {src} (tag {tag})", (src, dst), 0, p2p=True
        ):
            req.Wait(status)
        _check_count(status, buf, src, dst, tag)
        self._reap()
        return buf

    def _recv_buffer(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        """The host buffer a point-to-point receive lands in (a result buffer here)."""
        return self._result(math.prod(shape), dtype).reshape(shape)

    def _reap(self) -> None:
        """Forget sends that have completed (their buffers may go)."""
        if self._pending:
            self._pending = [p for p in self._pending if not p[0].Test()]

    def wait_pending_sends(self) -> None:
        """Block (under the deadline) until every ``send`` has been received; called at exit."""
        self._reap()
        if not self._pending:
            return
        targets = sorted({(dst, tag) for _, _, dst, tag in self._pending})
        dsts = sorted({d for d, _ in targets})
        what = ", ".join(f"rank {d} (tag {t})" for d, t in targets)
        with self._rt.watchdog.watch(
            f"exit: sends to {what} not yet received", tuple(sorted({self.rank, *dsts})), 0, p2p=True
        ):
            MPI.Request.Waitall([p[0] for p in self._pending])
        self._pending = []


class _StartedAllReduce(Pending):
    """An all-reduce in non-blocking MPI calls, with the blocking ordered one's result bit for bit.

    Phase 1 on the group's first started communicator: every member's n element ranges (the
    chunking rule) go to their members as point-to-point messages, all posted at once, or for
    small buffers (``gathers_whole``) one ``Iallgather`` of whole buffers.
    Once phase 1 is complete, this member reduces its range over the n members in group order
    (``reduce_rows``: element i is ((a0 + a1) + a2) + ... as in every other path) straight into
    its place in the result, and phase 2 sends it to every member and receives theirs (one
    round of messages on the second communicator, as ``_gather_p2p``). ``MPIPAR_REDUCE=native``
    float sums are one ``Iallreduce`` instead (MPI's order, as the blocking native path). MPI
    moves the data of a posted phase while the caller computes (MPICH progresses it inside any
    later MPI call, ``test`` included); the local reduction runs in ``test`` or ``wait``,
    whichever first finds phase 1 complete. Messages between two members on one communicator
    match in posting order, and every member posts its buckets' phases in start order.
    """

    def __init__(
        self, owner: MPICommunicator, group: Group, a: np.ndarray, op: str, seq: int, native: Any | None
    ) -> None:
        self.owner, self.group, self.op, self.seq = owner, group, op, seq
        self.shape = tuple(a.shape)
        self.label = f"all_reduce({op}) started"
        n, i = len(group), group.index(owner.rank)
        flat = owner._flat(a, a.dtype)
        self.send: np.ndarray | None = flat  # referenced until phase 1 is complete: MPI reads it meanwhile
        size = flat.size
        first, self.second = owner._rt.started_for(group)
        self.result: np.ndarray | None = None
        self.rows: np.ndarray | None = None
        self.size = size
        # The agreement check (``agreement``): a trailer on the gathered buffer, else a ring
        # message posted with phase 1 and compared when phase 1 completes.
        self.words: np.ndarray | None = None
        self.ring: Any = None
        self.facts = ("all_reduce", flat.dtype, op, {"shape": self.shape}, seq)
        if owner.agree and not owner.check_collectives:
            self.words = signature_words("all_reduce", flat.dtype, op, {"shape": self.shape}, group, seq)
        if native is not None:
            self.out = owner._result(size, flat.dtype)
            self.phase = "native"
            self.reqs = [first.Iallreduce([flat, native], [self.out, native], op=MPI.SUM)]
        elif owner.gathers_whole(size, n, flat.itemsize):
            words = self.words
            extra = trailer_elements(flat.dtype) if words is not None else None
            if extra and words is not None:
                send = np.empty(size + extra, dtype=flat.dtype)
                send[:size] = flat
                send[size:].view(np.uint64)[:] = words
                self.send = flat = send
            self.rows = np.empty(n * flat.size, dtype=flat.dtype)
            self.phase = "gather" if extra or self.words is None else "gather-ring"
            self.reqs = [first.Iallgather(_spec(flat), _spec(self.rows))]
        else:
            self.lengths = lengths = tuple(e - s for s, e in (chunk_range(size, n, j) for j in range(n)))
            self.starts = starts = _starts(lengths)
            mine = lengths[i]
            self.out = owner._result(size, flat.dtype)
            self.rows = rows = np.empty(n * mine, dtype=flat.dtype)
            self.phase = "scatter"
            rows[i * mine : (i + 1) * mine] = flat[starts[i] : starts[i + 1]]
            peers = (*range(i + 1, n), *range(i))
            self.reqs = [first.Irecv(_spec(rows[j * mine : (j + 1) * mine]), j, STARTED_TAG) for j in peers if mine]
            self.reqs += [
                first.Isend(_spec(flat[starts[j] : starts[j + 1]]), j, STARTED_TAG) for j in peers if lengths[j]
            ]
        if self.words is not None and self.phase != "gather":  # the trailer did not fit: the ring
            self.ring = owner._ring_start(group, self.words, comm=first)
            self.reqs += self.ring[0]

    def _advance(self) -> None:
        """The requests of the current phase have completed: run what follows them."""
        n = len(self.group)
        if self.ring is not None:  # phase 1 is complete, the predecessor's signature with it
            ring, self.ring = self.ring, None
            me = self.owner.rank
            peer = self.group[(self.group.index(me) - 1) % n]
            assert self.words is not None
            problem = ring_problem(self.group, me, self.words, peer, ring[1], self.facts)
            if problem:
                raise CollectiveMismatchError(problem)
        if self.phase == "native":
            self.result = _averaged(self.out, self.op, n)
        elif self.phase in ("gather", "gather-ring"):
            assert self.rows is not None
            rows = self.rows.reshape(n, -1)
            if self.phase == "gather" and self.words is not None:
                self.owner._check_rows(self.group, rows, self.size, self.words, self.facts)
                rows = rows[:, : self.size]
            self.result = reduce_rows(rows, self.op, np)
        elif self.phase == "scatter":
            assert self.rows is not None
            i = self.group.index(self.owner.rank)
            lengths, starts, out = self.lengths, self.starts, self.out
            mine = lengths[i]
            reduce_rows(self.rows.reshape(n, mine), self.op, np, out=out[starts[i] : starts[i + 1]])
            self.phase = "allgather"
            self.send = self.rows = None
            peers = (*range(i + 1, n), *range(i))
            self.reqs = [
                self.second.Irecv(_spec(out[starts[j] : starts[j + 1]]), j, STARTED_TAG) for j in peers if lengths[j]
            ]
            if mine:
                self.reqs += [self.second.Isend(_spec(out[starts[i] : starts[i + 1]]), j, STARTED_TAG) for j in peers]
            return
        else:
            self.result = self.out
        self.reqs = []
        self.send = self.rows = None  # done with them: let the memory go

    def test(self) -> bool:
        while self.result is None and MPI.Request.Testall(self.reqs):
            self._advance()
        return self.result is not None

    def wait(self) -> dict[int, Array]:
        if self.result is None:
            with self.owner._watch(self.label, self.group, self.seq):
                while self.result is None:
                    MPI.Request.Waitall(self.reqs)
                    self._advance()
        return {self.owner.rank: self.result.reshape(self.shape)}


def _check_count(status: Any, buf: np.ndarray, src: int, dst: int, tag: int) -> None:
    got = status.Get_count(MPI.BYTE)
    if got != buf.nbytes:
        raise RuntimeError(
            f"rank {dst} expected {buf.dtype}{list(buf.shape)} ({buf.nbytes} bytes) from rank {src} (tag {tag}) "
            f"but received {got} bytes: sender and receiver disagree about the layout"
        )


class MPIBackend(Backend):
    """One process per rank over MPI (see the module docstring)."""

    name = "mpi"

    def __init__(self) -> None:
        self._rt = runtime()

    @property
    def comm(self) -> MPICommunicator:
        return self._rt.communicator

    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        return (self._rt.rank,) if self._rt.rank in mesh.process_ids else ()

    def hosts(self, rank: int) -> bool:
        return rank == self._rt.rank

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def world_size(self) -> int:
        return self._rt.size

    def describe(self) -> str:
        return f"mpi: rank {self._rt.rank} of {self._rt.size} ({MPI.Get_library_version().splitlines()[0].strip()})"

    @property
    def rank_hosts(self) -> list[str] | None:
        """Each rank's host as the launcher assigned it (``MPIPAR_HOST_MAP``), or None."""
        return self._rt.hosts

    def validate_mesh(self, mesh: ProcessMesh) -> None:
        super().validate_mesh(mesh)
        if self._rt.rank == 0:  # every rank sees the same mesh; one warning is enough
            warn_if_spans_hosts(mesh, self._rt.hosts)

    def trace_origin(self) -> float:
        """The shared time origin of measured timelines (a collective; see ``MPIRuntime``)."""
        return self._rt.trace_origin()

    def gather_at_root(self, arrays: Sequence[np.ndarray]) -> list[list[np.ndarray]] | None:
        """Every rank's arrays on rank 0 (a collective; see ``MPIRuntime.gather_at_root``)."""
        return self._rt.gather_at_root(arrays)
