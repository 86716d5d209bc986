"""Collectives that reduce locally in group order, over any transport that moves bytes.

The simulator reduces member buffers in group order (``mpipar.comm.reduce_arrays``). An
MPI or NCCL reduction would use its own order (ring, tree, recursive halving) and differ in
the last bits, so losses under ``mpiexec`` would drift from the simulator's. Here every
reduction moves data first and reduces locally, in group order, element by element:

=================  =====================================================================
collective          how (n members, member i)
=================  =====================================================================
all_reduce          all_to_all of n element ranges (the chunking rule), each member reduces
                    its range over the n members in group order, all_gather of the ranges.
                    Small buffers (n x size <= 1 MiB): all_gather whole buffers, reduce.
reduce_scatter      all_to_all of the chunks, member i reduces the n copies of chunk i
                    (the MPI transport folds each copy in as it arrives instead).
reduce              like all_reduce, with a gather to the root instead of an all_gather.
all_gather          all_gather with per-member counts (uneven pieces).
all_to_all          all_to_all with per-pair counts (uneven and empty pieces).
broadcast           broadcast of the root's bytes.
=================  =====================================================================

Bytes per member are those of a ring all-reduce (2 (n-1)/n of the buffer), so the price of
determinism is one local pass over the data (``benchmarks/runtime_collectives.py``
measures it against MPI's own ``Allreduce``).

**Uneven buffers** use the v-variants (``Alltoallv``, ``Allgatherv``, ``Gatherv``) with
exact per-member counts, never padding: pieces are packed back to back, so no byte is sent
that the receiver does not keep, and empty pieces cost nothing.

**Buffers.** Every result handed to a caller is an array of its own, never overwritten while
anything references it. Multi-MiB results come from ``ResultCache``: a buffer whose array
(and every view of it) has been dropped is handed out again for a result of the same size,
instead of fresh memory whose first touch costs a page fault per 4 KiB (at 64 MiB with 8
ranks on 2 cores, that doubles an all_gather's time). The cache keeps at most
``MPIPAR_COMM_CACHE_MIB`` (default 256) MiB of idle buffers per process; 0 turns it off.
Send buffers that must be packed and received chunks awaiting their reduction live only
inside one call: they come from a small scratch set, reused from call to call.

Subclasses supply the transport: five methods on flat, contiguous arrays with element
counts (``_t_alltoallv``, ``_t_allgatherv``, ``_t_gatherv``, ``_t_bcast``, ``_t_barrier``),
``_watch`` (the deadline around a blocking wait) and ``_check`` (the signature exchange of
``MPIPAR_CHECK_COLLECTIVES``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mpipar.comm import Array, BackToBack, Communicator, Group, Shape, recording, reduce_arrays, reduce_rows
from mpipar.env import env_choice, env_number
from mpipar.runtime.agreement import (
    TRAILER_BYTES,
    expected_from_predecessor,
    ring_problem,
    rows_problem,
    signature_words,
    trailer_elements,
)
from mpipar.runtime.faults import CollectiveMismatchError, report_mismatch_once, signature
from mpipar.spec import chunk_range

SMALL_REDUCE_BYTES = 1 << 20
"""All-reduce / reduce with n x buffer bytes up to this gather whole buffers (one collective)
and fold them locally, instead of reduce-scatter + all-gather (two collectives, each a
rendezvous of every member). ``benchmarks/mpi_transport_choices.py --all-reduce-kib`` puts the
crossover at about 1 MiB of n x size on 4 ranks (256 KiB each) and on 8 (128 KiB each):
below it one collective's fixed cost outweighs the n-fold bytes; above it the bytes win.
The total, not the per-member size, is what both the gather and the fold scale with."""
SCRATCH_BUFFERS = 4
"""How many temporary buffers (one per role, dtype and size) a communicator keeps."""
CACHE_ENV = "MPIPAR_COMM_CACHE_MIB"
DEFAULT_CACHE_MIB = 256.0
CACHED_MIN_BYTES = 1 << 20
"""Smaller results come from malloc's heap, which reuses memory without page faults anyway."""
CACHED_MAX_BUFFERS = 16


def cache_bytes_from_env(environ: Mapping[str, str] | None = None) -> int:
    """``MPIPAR_COMM_CACHE_MIB`` in bytes: the idle result buffers a communicator may keep."""
    mib = env_number(CACHE_ENV, DEFAULT_CACHE_MIB, minimum=0.0, strict=False, unit="MiB", env=environ)
    return int(mib * 2**20)


REDUCE_ENV = "MPIPAR_REDUCE"
REDUCE_MODES = ("ordered", "native")


def reduce_mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``MPIPAR_REDUCE``: ``ordered`` (the default: every sum in group order, bit-identical to
    the simulator) or ``native`` (floating-point sums by the MPI library's own reduction)."""
    return env_choice(
        REDUCE_ENV,
        REDUCE_MODES,
        "ordered",
        environ,
        explain="ordered: sums in group order, bit-identical to the simulator; native: the MPI library's own "
        "reduction, faster, equal to the simulator only to rounding",
    )


class ResultCache:
    """Reuses NumPy result buffers nobody references any more (a caching allocator).

    Each cached buffer is a flat uint8 *owner*; a result is a view of it, and every view of
    a view keeps the owner as its ``base``, so the owner's reference count tells whether
    anything (a shard, a slice of one, a memoryview, a pending MPI request) still uses it.
    Only an owner referenced by the cache alone is handed out again, for a result of the
    same byte size. Idle owners beyond ``idle_limit`` bytes or ``max_buffers`` entries are
    released, oldest first.
    """

    def __init__(
        self, idle_limit: int, max_buffers: int = CACHED_MAX_BUFFERS, min_bytes: int = CACHED_MIN_BYTES
    ) -> None:
        self.idle_limit = idle_limit
        self.max_buffers = max_buffers
        self.min_bytes = min_bytes
        # The count an owner shows when only the cache's list holds it, measured the way
        # ``_idle`` measures (interpreters differ in what a call adds).
        self._owners: list[np.ndarray] = [np.empty(1, dtype=np.uint8)]
        self._alone = sys.getrefcount(self._owners[0])
        self._owners = []
        self.reused = 0

    def _idle(self, i: int) -> bool:
        return sys.getrefcount(self._owners[i]) == self._alone

    def take(self, count: int, dtype: Any) -> np.ndarray:
        """A 1-d array of ``count`` elements of ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = int(count) * dtype.itemsize
        if self.idle_limit <= 0 or nbytes < self.min_bytes:
            return np.empty(count, dtype=dtype)
        for i in range(len(self._owners) - 1, -1, -1):  # most recently used first
            if self._owners[i].nbytes == nbytes and self._idle(i):
                owner = self._owners.pop(i)
                self._owners.append(owner)
                self.reused += 1
                return owner.view(dtype)
        owner = np.empty(nbytes, dtype=np.uint8)
        self._owners.append(owner)
        self._release_idle()
        if len(self._owners) > self.max_buffers:  # every other owner is in use: do not track this one
            self._owners.pop()
        return owner.view(dtype)

    def _release_idle(self) -> None:
        idle = [i for i in range(len(self._owners)) if self._idle(i)]
        idle_bytes = sum(self._owners[i].nbytes for i in idle)
        drop: set[int] = set()
        for i in idle:  # oldest first
            if idle_bytes <= self.idle_limit and len(self._owners) - len(drop) <= self.max_buffers:
                break
            drop.add(i)
            idle_bytes -= self._owners[i].nbytes
        if drop:
            self._owners = [o for j, o in enumerate(self._owners) if j not in drop]

    @property
    def held_bytes(self) -> int:
        """Bytes of every owner the cache tracks, in use or idle."""
        return sum(o.nbytes for o in self._owners)


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


@functools.lru_cache(maxsize=1024)
def _layout(shapes: tuple[Shape, ...]) -> tuple[tuple[int, ...], int, bool]:
    """Pieces of these shapes back to back: each one's element count, the total, and whether
    all have one shape (cached: a training step moves the same few layouts over and over, and
    counting them was a visible share of a small collective's Python time)."""
    counts = tuple(_prod(s) for s in shapes)
    return counts, sum(counts), bool(shapes) and shapes.count(shapes[0]) == len(shapes)


@functools.lru_cache(maxsize=1024)
def _starts(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Where each piece of these element counts starts when all are packed back to back, then the end."""
    out, at = [0], 0
    for c in counts:
        at += c
        out.append(at)
    return tuple(out)


class OrderedCommunicator(Communicator):
    """The collective algorithms of the module docstring; transport left to subclasses."""

    rank: int
    """This process's world rank: the one member it hosts."""
    check_collectives: bool = False
    agree: bool = False
    """Check each collective's signature through its own messages (``mpipar.runtime.agreement``;
    ``MPIPAR_AGREE``, on by default where the transport supports it)."""
    small_reduce_bytes: int = SMALL_REDUCE_BYTES
    """``gathers_whole``'s threshold (an attribute so a benchmark can move it)."""

    def gathers_whole(self, size: int, members: int, itemsize: int) -> bool:
        """Does an all-reduce / reduce of ``size`` elements per member over ``members`` all-gather
        whole buffers (one collective, then the fold) rather than reduce-scatter + all-gather?

        The same answer on every member (it depends on facts they share), so all choose alike.
        """
        return size * members * itemsize <= self.small_reduce_bytes or size < members

    def __init__(self) -> None:
        self._trailer: tuple[np.ndarray, tuple[Any, ...]] | None = None
        self._seq: dict[Group, int] = {}
        self._scratch_bufs: dict[tuple[str, str, int], Array] = {}
        self._results = ResultCache(cache_bytes_from_env())

    @property
    def xp(self) -> Any:
        return np

    # ------------------------------------------------------------------ transport
    @abstractmethod
    def _t_alltoallv(
        self, group: Group, send: Array, scounts: Sequence[int], recv: Array, rcounts: Sequence[int]
    ) -> None:
        """Member i sends ``send``'s j-th piece (``scounts[j]`` elements, packed) to member j."""

    def _t_alltoall(self, group: Group, send: Array, recv: Array, count: int) -> None:
        """``_t_alltoallv`` with ``count`` elements to and from every member, a fact every
        member knows (a transport may then use a cheaper call)."""
        counts = [count] * len(group)
        self._t_alltoallv(group, send, counts, recv, counts)

    @abstractmethod
    def _t_allgatherv(self, group: Group, send: Array, recv: Array, counts: Sequence[int]) -> None: ...

    def _t_allgather_in_place(self, group: Group, recv: Array, counts: Sequence[int]) -> None:
        """``_t_allgatherv`` whose own piece already lies in its place in ``recv``."""
        starts = _starts(tuple(counts))
        i = group.index(self.rank)
        own = recv[starts[i] : starts[i + 1]].copy()  # a transport may not read and write one buffer
        self._t_allgatherv(group, own, recv, counts)

    @abstractmethod
    def _t_gatherv(self, group: Group, root: int, send: Array, recv: Array | None, counts: Sequence[int]) -> None:
        """``root`` is a member index; ``recv`` is None on the other members."""

    @abstractmethod
    def _t_bcast(self, group: Group, buf: Array, root: int) -> None: ...

    @abstractmethod
    def _t_barrier(self, group: Group) -> None: ...

    @abstractmethod
    def _watch(self, op: str, group: Group, seq: int) -> contextlib.AbstractContextManager[Any]: ...

    @abstractmethod
    def _check(self, group: Group, seq: int, sig: dict[str, Any]) -> None: ...

    # ------------------------------------------------------------------ agreement transport
    def _ring_start(self, group: Group, words: np.ndarray, comm: Any = None) -> Any:
        """Send ``words`` to the ring successor, receive the predecessor's (started, not waited)."""
        raise NotImplementedError

    def _ring_test(self, handle: Any) -> np.ndarray | None:
        """The predecessor's words if they have arrived (never blocks)."""
        raise NotImplementedError

    def _ring_wait(self, handle: Any, limit_s: float | None = None) -> np.ndarray | None:
        """The predecessor's words, waiting for them (at most ``limit_s`` seconds when given)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _collective(
        self,
        group: Group,
        op: str,
        *,
        dtype: Any,
        reduce_type: str | None = None,
        trailer: bool = False,
        **parts: Any,
    ) -> contextlib.AbstractContextManager[Any]:
        """Number the call on its group, check signatures if asked, and run it under a deadline.

        The arguments are ``signature``'s; the signature itself is built only in check mode
        (building it for every call cost a small collective a measurable share of its time).
        A timeout report names the op as ``all_reduce(sum)``. With ``agree`` (the default on
        MPI) the call's signature words travel with it: as the trailer of the buffer a gathered
        reduction sends (``trailer``: the caller's ``_reduce_to`` picks them up), else as one
        message to the ring successor, waited for with the call.
        """
        seq = self._number(group, op, dtype=dtype, reduce_type=reduce_type, **parts)
        watch = self._watch(f"{op}({reduce_type})" if reduce_type else op, group, seq)
        if not self.agree or self.check_collectives:
            return watch
        if "sends" in parts:
            parts["me"] = self.rank
        words = signature_words(op, dtype, reduce_type, parts, group, seq)
        facts = (op, dtype, reduce_type, parts, seq)
        if trailer:
            self._trailer = (words, facts)
            return watch
        expect = expected_from_predecessor(parts, group) if "recvs" in parts else None
        return _Agreed(self, group, words, facts, expect, watch)

    def _uses_trailer(self, size: int, n: int, dtype: Any) -> bool:
        """Does a reduction of ``size`` elements per member carry its signature as a trailer?"""
        return (
            self.agree and self.gathers_whole(size, n, np.dtype(dtype).itemsize) and trailer_elements(dtype) is not None
        )

    def _check_rows(self, group: Group, rows: Array, size: int, words: np.ndarray, facts: tuple[Any, ...]) -> None:
        """Compare every member's trailer (the columns after ``size``) with this member's words."""
        # The usual case, every trailer ours: one comparison of raw bytes (a trailer is bits,
        # and agreement means the same bits). It costs a tenth of the per-row NumPy comparison,
        # which only a mismatch needs (to name the first member that differs).
        if rows[:, size:].tobytes() == words.tobytes() * len(group):
            return
        tail = np.ascontiguousarray(rows[:, size:]).view(np.uint64).reshape(len(group), TRAILER_BYTES // 8)
        problem = rows_problem(group, self.rank, words, tail, facts)
        if problem:
            report_mismatch_once(group, self.rank, problem)

    def _number(self, group: Group, op: str, *, dtype: Any, reduce_type: str | None = None, **parts: Any) -> int:
        """The call's number on its group, after the check-mode signature exchange if asked
        (``_collective`` without the deadline: a started collective is waited for later)."""
        seq = self._seq[group] = self._seq.get(group, 0) + 1
        if self.check_collectives:
            self._check(group, seq, signature(op, dtype=dtype, reduce_type=reduce_type, **parts))
        return seq

    def _mine(self, op: str, group: Group, bufs: Mapping[int, Any]) -> Any:
        if self.rank not in bufs:
            raise RuntimeError(
                f"{op} on group {list(group)}: rank {self.rank} takes part but passed no buffer "
                f"(buffers given for {sorted(bufs)}); this is a bug in the caller"
            )
        return bufs[self.rank]

    def _flat(self, a: Array, dtype: Any) -> Array:
        """A contiguous 1-d array of ``a``'s elements in ``dtype`` (no copy when already so)."""
        return self.xp.ascontiguousarray(a, dtype=dtype).reshape(-1)

    def _pack(self, pieces: Sequence[Array], dtype: Any) -> Array:
        """The pieces back to back in one flat send buffer: a view when they already lie so,
        else copied (strided pieces straight from their place) into a scratch buffer."""
        if not pieces:
            return self.xp.empty(0, dtype=dtype)
        if isinstance(pieces, BackToBack) and pieces.flat.dtype == dtype:
            return pieces.flat  # the caller vouches for the layout (row blocks of one shard)
        joined = _adjacent_view(pieces, dtype)
        if joined is not None:
            return joined
        out = self._scratch(sum(_prod(p.shape) for p in pieces), dtype, role="send")
        at = 0
        for p in pieces:
            size = _prod(p.shape)
            out[at : at + size].reshape(p.shape)[...] = p
            at += size
        return out

    def _result(self, count: int, dtype: Any) -> Array:
        """A buffer for a result handed to the caller (``ResultCache`` on NumPy)."""
        if self.xp is np:
            return self._results.take(count, dtype)
        return self.xp.empty(count, dtype=dtype)

    def _scratch(self, count: int, dtype: Any, role: str = "recv") -> Array:
        """A reusable temporary buffer that dies inside one collective (``role``: what for,
        so a call's send and receive buffers never coincide)."""
        key = (role, np.dtype(dtype).str, int(count))
        buf = self._scratch_bufs.pop(key, None)
        if buf is None:
            buf = self.xp.empty(count, dtype=dtype)
        self._scratch_bufs[key] = buf  # most recently used last
        while len(self._scratch_bufs) > SCRATCH_BUFFERS:
            self._scratch_bufs.pop(next(iter(self._scratch_bufs)))
        return buf

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, group: Group, bufs: Mapping[int, Array], op: str) -> dict[int, Array]:
        a = self._mine("all_reduce", group, bufs)
        n = len(group)
        if n == 1:
            return {self.rank: reduce_arrays([a], op, self.xp)}
        dtype, shape = a.dtype, tuple(a.shape)
        trailer = self._uses_trailer(a.size, n, dtype)
        with self._collective(group, "all_reduce", dtype=dtype, reduce_type=op, trailer=trailer, shape=shape):
            out = self._reduce_to(group, a, op, root=None)
        return {self.rank: out.reshape(shape)}

    def _reduce(self, group: Group, bufs: Mapping[int, Array], op: str, root: int) -> dict[int, Array]:
        a = self._mine("reduce", group, bufs)
        n = len(group)
        if n == 1:
            return {self.rank: reduce_arrays([a], op, self.xp)}
        dtype, shape = a.dtype, tuple(a.shape)
        trailer = self._uses_trailer(a.size, n, dtype)
        with self._collective(group, "reduce", dtype=dtype, reduce_type=op, trailer=trailer, shape=shape, root=root):
            out = self._reduce_to(group, a, op, root=group.index(root))
        return {self.rank: out.reshape(shape)} if out is not None else {}

    def _reduce_to(self, group: Group, a: Array, op: str, root: int | None) -> Array | None:
        """The ordered reduction of every member's ``a``: on all members, or on member ``root``."""
        xp, n, i = self.xp, len(group), group.index(self.rank)
        flat = self._flat(a, a.dtype)
        size = flat.size
        if self.gathers_whole(size, n, flat.itemsize):
            agreed, self._trailer = self._trailer, None
            width, send = size, flat
            if agreed is not None:  # the signature rides as the buffer's trailer (agreement.py)
                width = size + (trailer_elements(flat.dtype) or 0)
                send = self._scratch(width, flat.dtype, role="send")
                send[:size] = flat
                send[size:].view(np.uint64)[:] = agreed[0]
            if root is None:
                rows = xp.empty(n * width, dtype=flat.dtype)
                self._t_allgatherv(group, send, rows, [width] * n)
            else:
                rows = xp.empty(n * width, dtype=flat.dtype) if i == root else None
                self._t_gatherv(group, root, send, rows, [width] * n)
                if rows is None:
                    return None
            rows = rows.reshape(n, width)
            if agreed is not None:
                self._check_rows(group, rows, size, *agreed)
                rows = rows[:, :size]  # the fold reads the data columns only: the same bits
            return reduce_rows(rows, op, xp)
        lengths = tuple(e - s for s, e in (chunk_range(size, n, j) for j in range(n)))
        same = size % n == 0
        if root is None:
            out = self._result(size, flat.dtype)
            starts = _starts(lengths)
            # Member i reduces its range straight into its place in the result, which the
            # all-gather then fills around it.
            self._scatter_reduce(group, flat, lengths, same, op, out=out[starts[i] : starts[i + 1]])
            self._t_allgather_in_place(group, out, lengths)
            return out
        part = self._scatter_reduce(group, flat, lengths, same, op)
        out = self._result(size, flat.dtype) if i == root else None
        self._t_gatherv(group, root, part, out, lengths)
        return out

    def _scatter_reduce(
        self, group: Group, send: Array, counts: tuple[int, ...], same: bool, op: str, out: Array | None = None
    ) -> Array:
        """Member i's share of a reduce-scatter: the reduction, in group order, of every
        member's i-th piece of ``send`` (pieces of ``counts[j]`` elements back to back, the
        same counts on every member; ``same``: all equal). Written into ``out`` (1-d,
        ``counts[i]`` elements) when given, else into a new array.

        This version moves every piece first (one all-to-all into a scratch buffer), then
        reduces; a transport may instead reduce each piece as it arrives.
        """
        n, i = len(group), group.index(self.rank)
        mine = counts[i]
        received = self._scratch(n * mine, send.dtype)
        if same:
            self._t_alltoall(group, send, received, mine)
        else:
            self._t_alltoallv(group, send, counts, received, [mine] * n)
        return reduce_rows(received.reshape(n, mine), op, self.xp, out=out)

    def _reduce_scatter(self, group: Group, chunks: Mapping[int, Sequence[Array]], op: str) -> dict[int, Array]:
        row = self._mine("reduce_scatter", group, chunks)
        if not isinstance(row, list):
            row = list(row)
        n, i = len(group), group.index(self.rank)
        if len(row) != n:
            raise RuntimeError(
                f"reduce_scatter on group {list(group)}: rank {self.rank} passes {len(row)} chunks for {n} members"
            )
        if n == 1:
            return {self.rank: reduce_arrays([row[0]], op, self.xp)}
        dtype = row[0].dtype
        shapes = tuple(c.shape for c in row)
        # The counts are the same on every member (the chunking of one shape), so all agree
        # whether the pieces are equal.
        counts, _, same = _layout(shapes)
        with self._collective(group, "reduce_scatter", dtype=dtype, reduce_type=op, shapes=shapes):
            part = self._scatter_reduce(group, self._pack(row, dtype), counts, same, op)
        return {self.rank: part.reshape(shapes[i])}

    def all_gather_flat(self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]) -> dict[int, Array]:
        if recording():  # the recorded path: an all_gather, then joined
            return super().all_gather_flat(group, bufs, shapes)
        group, shapes = tuple(group), tuple(map(tuple, shapes))
        a = self._gather_input(group, bufs, shapes)
        return {self.rank: self._gather_flat(group, a, shapes) if len(group) > 1 else self._flat(a, a.dtype)}

    def _all_gather(self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]) -> dict[int, list[Array]]:
        shapes = tuple(shapes)
        a = self._gather_input(group, bufs, shapes)
        if len(group) == 1:
            return {self.rank: [a]}
        return {self.rank: _split(self._gather_flat(group, a, shapes), shapes, _layout(shapes)[2])}

    def _gather_input(self, group: Group, bufs: Mapping[int, Array], shapes: tuple[Shape, ...]) -> Array:
        a = self._mine("all_gather", group, bufs)
        i = group.index(self.rank)
        if a.shape != shapes[i]:
            raise RuntimeError(
                f"all_gather on group {list(group)}: rank {self.rank} passes shape {list(a.shape)}, others expect {list(shapes[i])}"
            )
        return a

    def _gather_flat(self, group: Group, a: Array, shapes: tuple[Shape, ...]) -> Array:
        """This rank's all_gather of ``a``: every member's buffer back to back in one new flat array."""
        counts, total, _ = _layout(shapes)
        with self._collective(group, "all_gather", dtype=a.dtype, shapes=shapes):
            out = self._result(total, a.dtype)
            self._t_allgatherv(group, self._flat(a, a.dtype), out, counts)
        return out

    def _all_to_all(
        self, group: Group, chunks: Mapping[int, Sequence[Array]], recv_shapes: Mapping[int, Sequence[Shape]]
    ) -> dict[int, list[Array]]:
        row = list(self._mine("all_to_all", group, chunks))
        n = len(group)
        if len(row) != n:
            raise RuntimeError(
                f"all_to_all on group {list(group)}: rank {self.rank} passes {len(row)} chunks for {n} members"
            )
        expect = [tuple(int(d) for d in s) for s in recv_shapes[self.rank]]
        if n == 1:
            return {self.rank: row}
        dtype = row[0].dtype
        sends = [tuple(c.shape) for c in row]
        with self._collective(group, "all_to_all", dtype=dtype, sends=sends, recvs=expect):
            send = self._pack(row, dtype)
            out = self._result(sum(_prod(s) for s in expect), dtype)
            self._t_alltoallv(group, send, [_prod(s) for s in sends], out, [_prod(s) for s in expect])
        return {self.rank: _split(out, expect)}

    def _broadcast(
        self, group: Group, bufs: Mapping[int, Array | None], root: int, shape: Shape, dtype: np.dtype
    ) -> dict[int, Array]:
        self._mine("broadcast", group, bufs)
        if self.rank == root:
            value = bufs[root]
            if value is None or tuple(value.shape) != tuple(shape):
                got = "no buffer" if value is None else f"{value.dtype}{list(value.shape)}"
                raise RuntimeError(f"broadcast root {root} passes {got}, members expect {dtype}{list(shape)}")
            buf = self.xp.ascontiguousarray(value, dtype=dtype).reshape(shape)
        else:
            buf = self._result(_prod(shape), dtype).reshape(shape)
        if len(group) > 1:
            with self._collective(group, "broadcast", dtype=dtype, shape=tuple(shape), root=root):
                self._t_bcast(group, buf.reshape(-1), group.index(root))
        return {self.rank: buf}

    def _barrier(self, group: Group) -> None:
        if self.rank not in group or len(group) == 1:
            return
        with self._collective(group, "barrier", dtype=""):
            self._t_barrier(group)


class _Agreed:
    """The context of a collective whose signature goes to the ring successor (``agreement``):
    posted on entry, compared on exit (and by the watchdog while the call blocks)."""

    __slots__ = ("comm", "expect", "facts", "group", "handle", "lock", "waiting", "watch", "words")

    def __init__(
        self,
        comm: OrderedCommunicator,
        group: Group,
        words: np.ndarray,
        facts: tuple[Any, ...],
        expect: int | None,
        watch: contextlib.AbstractContextManager[Any],
    ) -> None:
        self.comm, self.group, self.words, self.facts, self.expect, self.watch = (
            comm,
            group,
            words,
            facts,
            expect,
            watch,
        )
        self.handle: Any = None
        self.waiting: Any = None
        self.lock = threading.Lock()

    def __enter__(self) -> Any:
        self.waiting = waiting = self.watch.__enter__()
        self.handle = self.comm._ring_start(self.group, self.words)
        if waiting is not None:
            waiting.agreement = self._poll
        return waiting

    def _problem(self, theirs: np.ndarray) -> str | None:
        group = self.group
        me = self.comm.rank
        peer = group[(group.index(me) - 1) % len(group)]
        return ring_problem(group, me, self.words, peer, theirs, self.facts, self.expect)

    def _poll(self) -> str | None:
        """Called by the watchdog thread while the call blocks."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self.handle is None:
                return None
            theirs = self.comm._ring_test(self.handle)
            return self._problem(theirs) if theirs is not None else None
        finally:
            self.lock.release()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        with self.lock:
            if self.waiting is not None:
                self.waiting.agreement = None
            handle, self.handle = self.handle, None
        problem = None
        if handle is not None:
            try:
                # After a failed call the predecessor's words may never come: look briefly.
                theirs = self.comm._ring_wait(handle, None if exc is None else 2.0)
            except Exception:
                theirs = None
                if exc is None:
                    raise
            problem = self._problem(theirs) if theirs is not None else None
        if problem:
            self.watch.__exit__(None, None, None)
            raise CollectiveMismatchError(problem) from exc
        self.watch.__exit__(exc_type, exc, tb)  # type: ignore[arg-type]


def _adjacent_view(pieces: Sequence[Array], dtype: Any) -> Array | None:
    """One flat view over ``pieces`` when they are C-contiguous NumPy arrays of ``dtype`` lying
    back to back in one buffer (row blocks of a contiguous array, as P -> S(0) cuts them)."""
    # Exactly NumPy's type: a subclass (another array library's host-backed arrays) gets a copy
    # of its own kind, not a plain ndarray view it could not hand to its transport.
    if not all(type(p) is np.ndarray and p.dtype == dtype and p.flags.c_contiguous for p in pieces):
        return None
    filled = [p for p in pieces if p.size]  # an empty piece may point anywhere
    if not filled:
        return None
    first = filled[0]
    root = first
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not root.flags.c_contiguous:
        return None
    start = first.__array_interface__["data"][0]
    at = start
    for p in filled:
        if p.__array_interface__["data"][0] != at:
            return None
        at += p.nbytes
    root_start = root.__array_interface__["data"][0]
    if start < root_start or at > root_start + root.nbytes:
        return None
    return np.ndarray((int((at - start) // first.itemsize),), dtype=dtype, buffer=root, offset=start - root_start)


def _split(flat: Array, shapes: Sequence[Shape], same: bool | None = None) -> BackToBack:
    """Views of consecutive pieces of ``flat`` with the given shapes (``same``: whether all
    shapes are equal, when the caller knows)."""
    first = shapes[0] if shapes else ()
    if same is None:
        same = all(s == first for s in shapes)
    if first and same and isinstance(flat, np.ndarray):
        # Equal pieces: one reshape, and iterating it makes the n views in C.
        return BackToBack(flat.reshape((len(shapes), *first)), flat)
    out, start = [], 0
    for s in shapes:
        count = _prod(s)
        out.append(flat[start : start + count].reshape(s))
        start += count
    return BackToBack(out, flat)
