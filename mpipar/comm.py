"""The Communicator interface: collectives over rank groups on the buffers this process hosts.

Every method takes a rank ``group`` (process ids, in the order that defines chunk and member
positions) and the buffers of the members this process hosts, keyed by rank, and returns the
results of those members. Under MPI a process hosts one member; in the simulator it hosts all
of them and a single call computes everything. Shapes a member cannot know from its own input
(uneven pieces it is about to receive) are passed in: the reshard plan knows them on every rank.

Implementations override the ``_``-prefixed methods; the public ones record one
``CommEvent`` per call into every active ``CommDebugMode`` (and into the tracer, if any),
and, while a measured timeline is being recorded (``MPIPAR_TRACE``), each call's start and
end on the lanes of the members this process hosts (``_span_recorders``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mpipar._deferred import Product, sum_products, written
from mpipar._xp import array_module

Array = Any  # numpy.ndarray or cupy.ndarray
Shape = tuple[int, ...]
Group = tuple[int, ...]

REDUCE_OPS = ("sum", "avg", "max", "min")


class BackToBack(list):  # type: ignore[type-arg]
    """Received pieces that lie in order, back to back, in one flat buffer ``flat``.

    A collective that receives into one buffer returns its pieces as this list, so a
    reshard whose pieces tile the result in that order takes ``flat`` as the result: no
    copy, and no per-piece address checks (each a Python call into NumPy).
    """

    def __init__(self, pieces: Iterable[Array], flat: Array) -> None:
        super().__init__(pieces)
        self.flat = flat


@dataclass(frozen=True)
class CommEvent:
    """One collective call on one rank group (or one point-to-point transfer)."""

    op: str
    ranks: tuple[int, ...]
    input_nbytes: int
    output_nbytes: int
    dtype: str
    reduce_type: str | None = None
    context: str = ""
    """Why the step ran: the reshard step and, for op inputs, the op and rule that asked."""

    def __str__(self) -> str:
        rt = f"({self.reduce_type})" if self.reduce_type else ""
        why = f"  # {self.context}" if self.context else ""
        return f"{self.op}{rt} ranks={list(self.ranks)} in={self.input_nbytes}B out={self.output_nbytes}B{why}"


class ManualTransport(Protocol):
    """Manual mode's transport (``mpipar.collective``): moves one rank's buffers; each method
    returns this rank's result (``group`` has >= 2 members). A backend running one program per
    rank in one process supplies it (``Backend.manual_transport``)."""

    def all_reduce(self, group: tuple[int, ...], buf: Array, op: str) -> Array: ...
    def all_gather(self, group: tuple[int, ...], buf: Array) -> list[Array]: ...
    def reduce_scatter(self, group: tuple[int, ...], chunks: Sequence[Array], op: str) -> Array: ...
    def all_to_all(
        self, group: tuple[int, ...], chunks: Sequence[Array], recv_shapes: Sequence[Shape]
    ) -> list[Array]: ...
    def broadcast(self, group: tuple[int, ...], buf: Array, root: int) -> Array: ...
    def reduce(self, group: tuple[int, ...], buf: Array, op: str, root: int) -> Array | None: ...
    def barrier(self, group: tuple[int, ...]) -> None: ...
    def send(self, dst: int, buf: Array) -> None: ...
    def recv(self, src: int, shape: Shape, dtype: np.dtype) -> Array: ...


class CommRecorder(Protocol):
    """Hears every collective as a ``CommEvent`` (``debug.CommDebugMode``)."""

    def record(self, event: CommEvent) -> None: ...


class CommSpanRecorder(Protocol):
    """Hears each public call's interval (``debug.measured``): ``ranks`` the members taking
    part (recorders keep those this process hosts), times from ``span_clock``."""

    def record_comm(
        self, name: str, kind: str, ranks: Sequence[int], start: float, end: float, peer: int | None
    ) -> None: ...


# Recorders (CommDebugMode instances, tracers) register here; the base class feeds them.
_recorders: list[CommRecorder] = []
_context: list[str] = []
# Span recorders (measured timelines) register here. Empty: calls are not timed at all.
_span_recorders: list[CommSpanRecorder] = []
span_clock = time.perf_counter


def recording() -> bool:
    """Is anything recording communication (events or spans)? Fast paths that skip the
    bookkeeping must not run while something records."""
    return bool(_recorders or _span_recorders)


def _span_start() -> float:
    return span_clock() if _span_recorders else 0.0


class comm_context:
    """Label every communication event recorded inside with ``reason`` (nesting joins with ' / ').

    A class, not a generator context manager: it wraps every reshard step and op input, and
    a generator's setup is a measurable share of a small collective under ``mpiexec``.
    """

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __enter__(self) -> None:
        _context.append(self.reason)

    def __exit__(self, *exc: object) -> None:
        _context.pop()


def current_context() -> str:
    return " / ".join(_context)


@dataclass(frozen=True)
class ReusedReshard:
    """A reshard a consumer did not make because an earlier one had (each reshard once): no call."""

    src: str
    dst: str
    dtype: str
    context: str

    def __str__(self) -> str:
        return f"reused {self.src} -> {self.dst} {self.dtype} (no call)  # {self.context}"


def note_reused_reshard(src: str, dst: str, dtype: Any) -> None:
    """Tell the recorders that want it (``CommDebugMode``) that a reshard was reused."""
    if not _recorders:
        return
    note = ReusedReshard(src, dst, str(np.dtype(dtype)), current_context())
    for rec in list(_recorders):
        record_reused = getattr(rec, "record_reused", None)
        if record_reused is not None:
            record_reused(note)


def _nbytes(arrays: Sequence[Array]) -> int:
    return int(sum(int(a.nbytes) for a in arrays))


def _dtype_name(arrays: Sequence[Array], fallback: Any = None) -> str:
    for a in arrays:
        return str(a.dtype)
    return str(np.dtype(fallback)) if fallback is not None else ""


@dataclass
class PointToPoint:
    """One point-to-point transfer inside ``Communicator.exchange``."""

    src: int
    dst: int
    tag: int
    shape: Shape
    dtype: Any
    data: Array | None = field(default=None, repr=False)


class Pending:
    """A started collective (``Communicator.all_reduce_start``): ``test()`` moves it on without
    blocking and says whether it is done; ``wait()`` blocks until it is and returns the
    result, keyed by hosted rank like the blocking call's."""

    def test(self) -> bool:
        return True

    def wait(self) -> dict[int, Array]:
        raise NotImplementedError


class Completed(Pending):
    """A collective that ran to completion when it was started (the blocking fallback)."""

    def __init__(self, result: dict[int, Array]) -> None:
        self.result = result

    def wait(self) -> dict[int, Array]:
        return self.result


class Communicator(ABC):
    """Collectives over rank groups. See the module docstring for the calling convention."""

    name = "abstract"

    # ------------------------------------------------------------------ recording
    def _record(
        self,
        op: str,
        ranks: Sequence[int],
        inputs: Sequence[Array],
        outputs: Sequence[Array],
        reduce_type: str | None = None,
        dtype: Any = None,
    ) -> None:
        if not _recorders:
            return
        event = CommEvent(
            op=op,
            ranks=tuple(int(r) for r in ranks),
            input_nbytes=_nbytes(inputs),
            output_nbytes=_nbytes(outputs),
            dtype=_dtype_name(list(inputs) + list(outputs), dtype),
            reduce_type=reduce_type,
            context=current_context(),
        )
        for rec in list(_recorders):
            rec.record(event)

    @staticmethod
    def _first(group: Group, hosted: Mapping[int, Any]) -> int | None:
        """The first member of ``group`` this process hosts: whose buffers an event reports."""
        for r in group:
            if r in hosted:
                return r
        return None

    @staticmethod
    def _span(name: str, ranks: Iterable[int], start: float, kind: str = "COLL", peer: int | None = None) -> None:
        """Report one call, from ``start`` to now, on the lanes of ``ranks`` (measured timelines)."""
        if not _span_recorders:
            return
        end = span_clock()
        members = tuple(ranks)
        for rec in list(_span_recorders):
            rec.record_comm(name, kind, members, start, end, peer)

    @classmethod
    def _span_group(cls, label: str, group: Group, hosted: Iterable[int], start: float) -> None:
        if _span_recorders:
            mine = set(hosted)
            cls._span(f"{label} on {list(group)}", [r for r in group if r in mine], start)

    # ------------------------------------------------------------------ public API
    def all_reduce(self, group: Group, bufs: Mapping[int, Array], op: str = "sum") -> dict[int, Array]:
        """Every member gets the reduction (in group order) of all members' buffers."""
        _check_op(op)
        if not recording():
            return self._all_reduce(tuple(group), bufs, op)
        start = _span_start()
        out = self._all_reduce(tuple(group), bufs, op)
        self._span_group(f"all_reduce({op})", group, bufs, start)
        m = self._first(group, bufs)
        if m is not None:
            self._record("all_reduce", group, [bufs[m]], [out[m]], op)
        return out

    def all_reduce_start(self, group: Group, bufs: Mapping[int, Array], op: str = "sum") -> Pending:
        """Start ``all_reduce``; its result comes from the returned ``Pending``'s ``wait()``.

        Every member must start its started collectives on a group in the same order, as for
        blocking ones. The result is the blocking call's, bit for bit (the same sum in group
        order); only when the data moves differs. Recorders hear the call when it starts.
        Transports without a non-blocking path run it to completion here.
        """
        _check_op(op)
        group = tuple(group)
        pending = self._all_reduce_start(group, bufs, op)
        m = self._first(group, bufs)
        if m is not None and _recorders:
            self._record("all_reduce", group, [bufs[m]], [bufs[m]], op)
        return pending

    def _all_reduce_start(self, group: Group, bufs: Mapping[int, Array], op: str) -> Pending:
        return Completed(self._all_reduce(group, bufs, op))

    def all_gather(self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]) -> dict[int, list[Array]]:
        """Every member gets the list of all members' buffers (``shapes[i]`` is member i's)."""
        if not recording():  # the hot path under mpiexec: nothing to report
            return self._all_gather(tuple(group), bufs, tuple(map(tuple, shapes)))
        start = _span_start()
        out = self._all_gather(tuple(group), bufs, tuple(map(tuple, shapes)))
        self._span_group("all_gather", group, bufs, start)
        m = self._first(group, bufs)
        if m is not None:
            self._record("all_gather", group, [bufs[m]], out[m])
        return out

    def all_gather_flat(self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]) -> dict[int, Array]:
        """``all_gather`` with each member's result as one flat array: the buffers back to
        back in member order, which is what an all-gather's receive buffer holds. For callers
        that want that concatenation itself (a reshard gathering slabs), without a view per piece."""
        return {r: _joined(pieces) for r, pieces in self.all_gather(group, bufs, shapes).items()}

    def reduce_scatter(self, group: Group, chunks: Mapping[int, Sequence[Array]], op: str = "sum") -> dict[int, Array]:
        """Member i gets the reduction over members of their ``chunks[member][i]``."""
        _check_op(op)
        if not recording():
            return self._reduce_scatter(tuple(group), chunks, op)
        start = _span_start()
        out = self._reduce_scatter(tuple(group), chunks, op)
        self._span_group(f"reduce_scatter({op})", group, chunks, start)
        m = self._first(group, chunks)
        if m is not None:
            self._record("reduce_scatter", group, list(chunks[m]), [out[m]], op)
        return out

    def all_to_all(
        self,
        group: Group,
        chunks: Mapping[int, Sequence[Array]],
        recv_shapes: Mapping[int, Sequence[Shape]],
    ) -> dict[int, list[Array]]:
        """Member r sends ``chunks[r][j]`` to member j; gets a list indexed by sender."""
        if not recording():
            return self._all_to_all(tuple(group), chunks, recv_shapes)
        start = _span_start()
        out = self._all_to_all(tuple(group), chunks, recv_shapes)
        self._span_group("all_to_all", group, chunks, start)
        m = self._first(group, chunks)
        if m is not None:
            self._record("all_to_all", group, list(chunks[m]), out[m])
        return out

    def broadcast(
        self, group: Group, bufs: Mapping[int, Array | None], root: int, shape: Shape, dtype: Any
    ) -> dict[int, Array]:
        """Every member gets the ``root`` member's buffer (non-roots may pass None)."""
        if root not in group:
            raise ValueError(f"broadcast root {root} is not in group {list(group)}")
        start = _span_start()
        out = self._broadcast(tuple(group), bufs, root, tuple(shape), np.dtype(dtype))
        self._span_group(f"broadcast(root {root})", group, bufs, start)
        m = self._first(group, bufs)
        if m is not None:
            inputs = [bufs[root]] if root in bufs and bufs[root] is not None else []
            self._record("broadcast", group, inputs, [out[m]], dtype=dtype)
        return out

    def reduce(self, group: Group, bufs: Mapping[int, Array], op: str, root: int) -> dict[int, Array]:
        """The ``root`` member gets the reduction (in group order); the result has only root."""
        _check_op(op)
        if root not in group:
            raise ValueError(f"reduce root {root} is not in group {list(group)}")
        start = _span_start()
        out = self._reduce(tuple(group), bufs, op, root)
        self._span_group(f"reduce({op}, root {root})", group, bufs, start)
        m = self._first(group, bufs)
        if m is not None:
            self._record("reduce", group, [bufs[m]], list(out.values()), op)
        return out

    def exchange(self, transfers: Sequence[PointToPoint], hosted: Sequence[int]) -> dict[tuple[int, int, int], Array]:
        """Run a batch of point-to-point transfers without deadlock.

        ``transfers`` lists every transfer any hosted rank takes part in; those whose sender
        is hosted carry ``data``. Returns the received arrays of hosted receivers, keyed
        ``(src, dst, tag)``. A transfer to oneself is a local copy, not a message.
        """
        hosted_set = set(hosted)
        local = {}
        remote = []
        for t in transfers:
            if t.src == t.dst:
                if t.src in hosted_set:
                    local[(t.src, t.dst, t.tag)] = t.data
            else:
                remote.append(t)
        start = _span_start()
        out = self._exchange(remote, hosted_set)
        if _span_recorders:
            self._span_exchange(remote, hosted_set, start)
        for t in remote:
            if t.src in hosted_set:
                self._record("send", (t.src, t.dst), [t.data], [t.data])
            elif t.dst in hosted_set:
                self._record("send", (t.src, t.dst), [], [out[(t.src, t.dst, t.tag)]])
        out.update(local)
        return out

    def send(self, src: int, dst: int, buf: Array, tag: int = 0) -> None:
        """Blocking-safe send (buffered until the matching ``recv``)."""
        start = _span_start()
        self._send(src, dst, buf, tag)
        self._span(f"send to {dst}", (src,), start, "SEND", dst)
        self._record("send", (src, dst), [buf], [buf])

    def recv(self, src: int, dst: int, shape: Shape, dtype: Any, tag: int = 0) -> Array:
        start = _span_start()
        out = self._recv(src, dst, tuple(shape), np.dtype(dtype), tag)
        self._span(f"recv from {src}", (dst,), start, "RECV", src)
        return out

    def barrier(self, group: Group) -> None:
        start = _span_start()
        self._barrier(tuple(group))
        self._span_group("barrier", tuple(group), group, start)  # recorders keep the hosted members

    @staticmethod
    def _span_exchange(transfers: Sequence[PointToPoint], hosted: set[int], start: float) -> None:
        """One span per hosted rank taking part: ``send to 4``, ``recv from 0``, ``exchange with 0, 4``."""
        sends: dict[int, set[int]] = {}
        recvs: dict[int, set[int]] = {}
        for t in transfers:
            if t.src in hosted:
                sends.setdefault(t.src, set()).add(t.dst)
            if t.dst in hosted:
                recvs.setdefault(t.dst, set()).add(t.src)
        for r in sorted(set(sends) | set(recvs)):
            out, into = sorted(sends.get(r, ())), sorted(recvs.get(r, ()))
            peers = sorted(set(out) | set(into))
            if out and into:
                name, kind = "exchange with " + ", ".join(map(str, peers)), "COLL"
            elif out:
                name, kind = "send to " + ", ".join(map(str, out)), "SEND"
            else:
                name, kind = "recv from " + ", ".join(map(str, into)), "RECV"
            Communicator._span(name, (r,), start, kind, peers[0] if len(peers) == 1 else None)

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def _all_reduce(self, group: Group, bufs: Mapping[int, Array], op: str) -> dict[int, Array]: ...

    @abstractmethod
    def _all_gather(
        self, group: Group, bufs: Mapping[int, Array], shapes: Sequence[Shape]
    ) -> dict[int, list[Array]]: ...

    @abstractmethod
    def _reduce_scatter(self, group: Group, chunks: Mapping[int, Sequence[Array]], op: str) -> dict[int, Array]: ...

    @abstractmethod
    def _all_to_all(
        self, group: Group, chunks: Mapping[int, Sequence[Array]], recv_shapes: Mapping[int, Sequence[Shape]]
    ) -> dict[int, list[Array]]: ...

    @abstractmethod
    def _broadcast(
        self, group: Group, bufs: Mapping[int, Array | None], root: int, shape: Shape, dtype: np.dtype
    ) -> dict[int, Array]: ...

    @abstractmethod
    def _reduce(self, group: Group, bufs: Mapping[int, Array], op: str, root: int) -> dict[int, Array]: ...

    @abstractmethod
    def _exchange(self, transfers: Sequence[PointToPoint], hosted: set[int]) -> dict[tuple[int, int, int], Array]: ...

    @abstractmethod
    def _send(self, src: int, dst: int, buf: Array, tag: int) -> None: ...

    @abstractmethod
    def _recv(self, src: int, dst: int, shape: Shape, dtype: np.dtype, tag: int) -> Array: ...

    @abstractmethod
    def _barrier(self, group: Group) -> None: ...


class NoCommunicator(Communicator):
    """The communicator of the one-big-device reference: any call is a bug, so it raises."""

    name = "none"

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise RuntimeError(
            "communication requested in --reference mode, where every tensor is one dense array; "
            "this is a bug in mpipar (please report it with the script that triggered it)"
        )

    _all_reduce = _all_gather = _reduce_scatter = _all_to_all = _fail  # type: ignore[assignment]
    _broadcast = _reduce = _exchange = _send = _recv = _barrier = _fail  # type: ignore[assignment]


def _joined(pieces: Sequence[Array]) -> Array:
    """Pieces back to back in one flat array (no copy when they were received so)."""
    if isinstance(pieces, BackToBack):
        return pieces.flat
    if len(pieces) == 1:
        return pieces[0].reshape(-1)
    xp = array_module(pieces[0])
    return xp.concatenate([xp.asarray(p).reshape(-1) for p in pieces])


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")


_BLOCK_ELEMS = 1 << 15  # 128-256 KiB per operand block: all operands of a block stay in cache


def reduce_arrays(arrays: Sequence[Array], op: str, xp: Any = np) -> Array:
    """Reduce in the given (group) order: the one summation order every backend uses.

    Element ``i`` of the result is always ``((a0[i] + a1[i]) + a2[i]) + ...`` (or the max/min
    chain), however the work is split. Large contiguous NumPy inputs are reduced block by
    block so each input is read once from memory instead of once per partial sum.
    """
    if type(arrays[0]) is Product:  # a process hosting every rank defers their products
        summed = sum_products(arrays, op)
        if summed is not None:
            return summed
        arrays = written(arrays)
    first = xp.asarray(arrays[0])  # a NumPy scalar would not add in place
    if (
        xp is np
        and len(arrays) > 2
        and first.size > 4 * _BLOCK_ELEMS
        and all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays)
    ):
        flat = [a.reshape(-1) for a in arrays]
        out = np.empty_like(flat[0])
        for start in range(0, out.size, _BLOCK_ELEMS):
            block = slice(start, start + _BLOCK_ELEMS)
            fold_into(out[block], [f[block] for f in flat], op, len(flat), xp)
        return out.reshape(first.shape)
    out = xp.empty(first.shape, dtype=first.dtype)  # C order, as ``first.copy()`` gave
    fold_into(out, [first, *(xp.asarray(a) for a in arrays[1:])], op, len(arrays), xp)
    return out


def reduce_rows(rows: Array, op: str, xp: Any = np, out: Array | None = None) -> Array:
    """``reduce_arrays`` of the rows of one 2-d array, in row order, bit for bit the same: for
    pieces received back to back, without a Python list of row views. Written into ``out``
    (1-d, one row's length) when given."""
    n, size = rows.shape
    if out is None:
        out = xp.empty(size, dtype=rows.dtype)
    if xp is np and n > 2 and size > 4 * _BLOCK_ELEMS and rows.flags.c_contiguous:
        for start in range(0, size, _BLOCK_ELEMS):
            block = slice(start, start + _BLOCK_ELEMS)
            fold_into(out[block], rows[:, block], op, n, xp)
        return out
    fold_into(out, rows, op, n, xp)
    return out


def fold_into(out: Array, arrays: Iterable[Array], op: str, count: int, xp: Any = np) -> None:
    """``out`` = the reduction of the ``count`` arrays in order: ``((a0 op a1) op a2) ...``.

    ``arrays`` may be lazy (an MPI transport yields each piece as it arrives). The first step
    writes ``a0 op a1`` straight into ``out`` rather than copying ``a0`` there first: one pass
    over the data fewer, and the same bits (the first partial result is that one operation
    either way)."""
    pieces = iter(arrays)
    if count == 1:
        out[...] = next(pieces)
        return
    combine = xp.add if op in ("sum", "avg") else xp.maximum if op == "max" else xp.minimum
    combine(next(pieces), next(pieces), out=out)
    for a in pieces:
        combine(out, a, out=out)
    if op == "avg":
        if np.issubdtype(out.dtype, np.integer):
            out //= count
        else:
            out /= out.dtype.type(count)
