"""A STAND-IN for CuPy and ``cupy.cuda.nccl``, used only by tests; never by the library.

This project's CI has no GPU, so the NCCL backend (``mpipar/runtime/nccl.py``) would never run.
Putting this directory first on ``PYTHONPATH`` makes ``import cupy`` load this module instead:

* arrays are NumPy arrays (``ndarray``, a subclass reporting module ``cupy``) in host memory;
  ``a.data.ptr`` is the buffer's address;
* ``cuda.Stream`` records the NCCL calls enqueued on it; ``synchronize()`` completes them; a
  read inside ``with stream:`` of what that stream's NCCL calls wrote is in stream order (allowed);
* NCCL's calls (``send``/``recv`` in ``groupStart``/``groupEnd``, ``allGather``, ``bcast``) are
  carried over MPI point-to-point messages on a private duplicate of ``MPI.COMM_WORLD``.

It checks the backend's discipline and raises ``DisciplineError`` where a real GPU would give
wrong data or hang: a buffer an NCCL call writes is read (by any array operation, ``get`` or
``asnumpy``) before its stream is synchronised; ``data.ptr`` is taken of a non-contiguous
array or an NCCL call's byte count runs past its buffer; ``groupEnd`` without ``groupStart``
(and a group left open at exit); a second NCCL communicator for the same group of processes.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
import types
from typing import Any, ClassVar

import numpy as np
from mpi4py import MPI

__version__ = "0.0-standin"
STANDIN = True


class DisciplineError(AssertionError):
    """The backend did something a real GPU and NCCL would punish (see the module docstring)."""


# ---------------------------------------------------------------------------- streams
class Stream:
    """A CUDA stream: the NCCL writes enqueued on it stay pending until ``synchronize()``."""

    _next = 1
    current: ClassVar[list[Stream]] = []

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = Stream._next
        Stream._next += 1
        self.pending: list[tuple[int, int]] = []  # (address, bytes) written by enqueued NCCL calls
        self.enqueued = 0
        self.synchronized = 0
        self.waited: list[Event] = []
        _STREAMS.append(self)

    def synchronize(self) -> None:
        self.synchronized += 1
        self.pending.clear()

    @property
    def done(self) -> bool:
        """Whether the stream's work has finished: the stand-in carries NCCL's calls at once,
        but what they wrote stays unreadable to the host until ``synchronize()``."""
        return True

    def record(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.stream = self
        return event

    def wait_event(self, event: Event) -> None:
        """Later work on this stream runs after the event's (the stand-in runs everything in order)."""
        self.waited.append(event)

    def __enter__(self) -> Stream:
        Stream.current.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        Stream.current.pop()


class Event:
    """A CUDA event: where a stream had got to when it was recorded."""

    def __init__(self) -> None:
        self.stream: Stream | None = None


_STREAMS: list[Stream] = []


def get_current_stream() -> Stream:
    """The stream ``with stream:`` made current, else the null stream."""
    return Stream.current[-1] if Stream.current else _NULL_STREAM


def _stream_of(ptr: int) -> Stream:
    for s in _STREAMS:
        if s.ptr == ptr:
            return s
    raise DisciplineError(f"NCCL call on stream pointer {ptr}, which no cuda.Stream has")


def _check_readable(arrays: Any) -> None:
    for a in arrays:
        if not isinstance(a, ndarray) or a.size == 0:
            continue
        lo = a.__array_interface__["data"][0]
        hi = lo + a.nbytes
        for s in _STREAMS:
            if Stream.current and s is Stream.current[-1]:
                continue  # a kernel on the writing stream runs after the NCCL call: stream order
            for addr, n in s.pending:
                if addr < hi and lo < addr + n:
                    raise DisciplineError(
                        f"a buffer written by an NCCL call on stream {s.ptr} is read before that stream is "
                        "synchronised: on a GPU this reads stale data (call stream.synchronize() first)"
                    )


# ---------------------------------------------------------------------------- arrays
class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _refuse_initial(name: str, kwargs: dict[str, Any]) -> None:
    """CuPy's max/min take no ``initial`` (NumPy's do): refuse it as CuPy does."""
    if name in ("max", "min", "amax", "amin") and "initial" in kwargs:
        raise TypeError(
            f"{name}() got an unexpected keyword argument 'initial' (CuPy has none; the stand-in refuses it too)"
        )


class ndarray(np.ndarray):
    """A "device" array: NumPy memory; reads checked against pending NCCL writes."""

    @property
    def data(self) -> _Pointer:  # type: ignore[override]
        if not self.flags.c_contiguous:
            raise DisciplineError(
                f"data.ptr of a non-contiguous array (shape {list(self.shape)}, strides {list(self.strides)}): "
                "NCCL would move the wrong bytes; make it contiguous first"
            )
        _BUFFERS[self.__array_interface__["data"][0]] = self.nbytes
        return _Pointer(self.__array_interface__["data"][0])

    def get(self) -> np.ndarray:
        _check_readable([self])
        return np.array(self, copy=True).view(np.ndarray)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _check_readable(inputs)
        if any(type(x) is np.ndarray and x.ndim > 0 for x in inputs):  # CuPy does not mix host and device arrays
            raise TypeError(
                f"{ufunc.__name__}: a host numpy.ndarray operand beside device arrays (CuPy refuses "
                "'Unsupported type <class numpy.ndarray>'; the stand-in refuses it too)"
            )
        if method == "at" and not isinstance(inputs[0], ndarray):  # CuPy scatters only into device memory
            raise TypeError(
                f"{ufunc.__name__}.at into a {type(inputs[0]).__name__} with device arrays: CuPy's "
                "scatter needs a device output (the stand-in refuses what CuPy refuses)"
            )
        args = [x.view(np.ndarray) if isinstance(x, ndarray) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(x.view(np.ndarray) if isinstance(x, ndarray) else x for x in kwargs["out"])
        return _device(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        _refuse_initial(getattr(func, "__name__", ""), kwargs)
        _check_readable([*args, *kwargs.values()])
        _check_readable([x for a in args if isinstance(a, (list, tuple)) for x in a])
        return _device(func(*_host(args), **_host(kwargs)))

    def __getitem__(self, key: Any) -> Any:
        _check_readable([self])
        return super().__getitem__(key)


ndarray.__module__ = "cupy"
_BUFFERS: dict[int, int] = {}  # address -> bytes of every buffer whose data.ptr was taken


def _host(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_host(v) for v in x)
    if isinstance(x, dict):
        return {k: _host(v) for k, v in x.items()}
    return x


def _device(x: Any) -> Any:
    if type(x) is np.ndarray:
        return x.view(ndarray)
    if isinstance(x, np.generic):  # CuPy's reductions return 0-d device arrays, never NumPy scalars
        return np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_device(v) for v in x)
    if isinstance(x, list):
        return [_device(v) for v in x]
    return x


def asarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if isinstance(a, ndarray):
        _check_readable([a])
    # host -> device is a copy, as cudaMemcpy is
    return np.array(_host(a), dtype=dtype, copy=True).view(ndarray)


def array(a: Any, dtype: Any = None, copy: bool = True) -> ndarray:
    _check_readable([a])
    return np.array(_host(a), dtype=dtype, copy=True).view(ndarray)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    _check_readable([a])
    out = np.ascontiguousarray(_host(a), dtype=dtype)
    return out.view(ndarray)


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return np.empty(shape, dtype=dtype).view(ndarray)


def asnumpy(a: Any) -> np.ndarray:
    _check_readable([a])
    return np.array(_host(a), copy=True)


def get_array_module(*args: Any) -> Any:
    return sys.modules[__name__]


_WRAPPED: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """Everything else is NumPy's, returning "device" arrays. Each wrapper is made once: CuPy's
    module functions are fixed objects (``cupy.ones is cupy.ones``), and mpipar's captured step
    compares the functions it records by identity between two traces."""
    if name in _WRAPPED:
        return _WRAPPED[name]
    attr = getattr(np, name)
    if isinstance(attr, np.ufunc):  # as CuPy's ufuncs: ``add.at`` and friends; the arrays' __array_ufunc__ checks reads
        _WRAPPED[name] = attr
        return attr
    if callable(attr) and not isinstance(attr, type):

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            _refuse_initial(name, kwargs)
            _check_readable(args)
            return _device(attr(*_host(args), **_host(kwargs)))

        wrapped.__name__ = wrapped.__qualname__ = name
        _WRAPPED[name] = wrapped
        return wrapped
    return attr


# ---------------------------------------------------------------------------- cuda
class Device:
    def __init__(self, index: int = 0) -> None:
        self.id = index

    def use(self) -> None:
        if self.id != 0:
            raise DisciplineError(f"Device({self.id}).use(): the stand-in has one device per process")


_runtime = types.ModuleType(f"{__name__}.cuda.runtime")
_runtime.getDeviceCount = lambda: 1  # type: ignore[attr-defined]
_cuda = types.ModuleType(f"{__name__}.cuda")
_NULL_STREAM = Stream()
_cuda.Stream = Stream  # type: ignore[attr-defined]
_cuda.Event = Event  # type: ignore[attr-defined]
_cuda.get_current_stream = get_current_stream  # type: ignore[attr-defined]
_cuda.Device = Device  # type: ignore[attr-defined]
_cuda.runtime = _runtime  # type: ignore[attr-defined]
_cuda.is_available = lambda: True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- nccl over MPI
class _Nccl:
    """State of the NCCL stand-in in this process."""

    world: Any = None
    group_depth = 0
    queued: ClassVar[list[tuple[str, int, int, int, Any, Stream]]] = []  # (kind, ptr, nbytes, peer, comm, stream)
    created: ClassVar[dict[tuple[int, ...], int]] = {}
    ids = 0
    calls: ClassVar[dict[str, int]] = {}


NCCL_UINT8 = 7
_SIZES = {NCCL_UINT8: 1}


def _world() -> Any:
    if _Nccl.world is None:
        _Nccl.world = MPI.COMM_WORLD.Dup()  # the first communicator is the world's: every process builds it
    return _Nccl.world


def get_unique_id() -> bytes:
    """128 bytes, as CuPy 14 returns it (earlier CuPy: a tuple of ints; mpipar takes both)."""
    _Nccl.ids += 1
    me = MPI.COMM_WORLD.Get_rank()
    raw = [me & 0x7F, me >> 7, _Nccl.ids & 0x7F, _Nccl.ids >> 7] + [0] * 124
    return bytes(raw)


def _bytes_at(ptr: int, nbytes: int) -> np.ndarray:
    for addr, size in _BUFFERS.items():
        if addr <= ptr and ptr + nbytes <= addr + size:
            break
    else:
        raise DisciplineError(f"NCCL call on {nbytes} bytes at {ptr}: not inside any buffer whose data.ptr was taken")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else np.empty(0, np.uint8)


class NcclCommunicator:
    """One NCCL communicator: ``n`` members, this one ``rank``, carried over MPI."""

    def __init__(self, n: int, uid: bytes, rank: int) -> None:
        if not isinstance(uid, bytes) or len(uid) != 128:  # CuPy 14 takes back the bytes get_unique_id gave
            raise TypeError(
                f"NcclCommunicator: the unique id must be the 128 bytes get_unique_id returned, got {type(uid).__name__}"
            )
        world = _world()
        root = (uid[0] & 0x7F) | (uid[1] << 7)
        serial = (uid[2] & 0x7F) | (uid[3] << 7)
        self.tag = 1 + root * 4096 + serial
        me = world.Get_rank()
        if rank == 0:
            members = [me] + [0] * (n - 1)
            for _ in range(n - 1):
                i, w = world.recv(source=MPI.ANY_SOURCE, tag=self.tag)
                members[i] = w
            for w in members[1:]:
                world.send(members, dest=w, tag=self.tag)
        else:
            world.send((rank, me), dest=root, tag=self.tag)
            members = world.recv(source=root, tag=self.tag)
        key = tuple(members)  # a group is ordered: member i is NCCL rank i
        if key in _Nccl.created:
            raise DisciplineError(
                f"a second NCCL communicator for processes {list(key)}: create one per group and reuse it"
            )
        _Nccl.created[key] = 1
        self.members = members
        self.rank = rank
        self.size = n
        self.aborted = False

    def _enqueue(self, kind: str, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        _Nccl.calls[kind] = _Nccl.calls.get(kind, 0) + 1
        nbytes = count * _SIZES[dtype]
        item = (kind, ptr, nbytes, peer, self, _stream_of(stream))
        if _Nccl.group_depth:
            _Nccl.queued.append(item)
        else:
            _run([item])

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._enqueue("send", ptr, count, dtype, peer, stream)

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._enqueue("recv", ptr, count, dtype, peer, stream)

    def allGather(self, sendptr: int, recvptr: int, count: int, dtype: int, stream: int) -> None:
        nbytes = count * _SIZES[dtype]
        s = _stream_of(stream)
        _Nccl.calls["allGather"] = _Nccl.calls.get("allGather", 0) + 1
        items = []
        for j in range(self.size):
            if j == self.rank:
                _bytes_at(recvptr + j * nbytes, nbytes)[...] = _bytes_at(sendptr, nbytes)
                s.pending.append((recvptr + j * nbytes, nbytes))
            else:
                items += [("send", sendptr, nbytes, j, self, s), ("recv", recvptr + j * nbytes, nbytes, j, self, s)]
        _run(items)

    def bcast(self, ptr: int, count: int, dtype: int, root: int, stream: int) -> None:
        nbytes = count * _SIZES[dtype]
        s = _stream_of(stream)
        _Nccl.calls["bcast"] = _Nccl.calls.get("bcast", 0) + 1
        if self.rank == root:
            _run([("send", ptr, nbytes, j, self, s) for j in range(self.size) if j != root])
        else:
            _run([("recv", ptr, nbytes, root, self, s)])

    def abort(self) -> None:
        self.aborted = True


def _run(items: list[tuple[str, int, int, int, Any, Stream]]) -> None:
    """Carry a batch of sends and receives over MPI; received bytes stay pending on their stream."""
    world = _world()
    reqs, landing = [], []
    for kind, ptr, nbytes, peer, comm, stream in items:
        if comm.aborted:
            raise DisciplineError("NCCL call on an aborted communicator")
        target = comm.members[peer]
        if kind == "send":
            reqs.append(world.Isend([np.array(_bytes_at(ptr, nbytes)), MPI.BYTE], dest=target, tag=comm.tag))
        else:
            buf = np.empty(nbytes, np.uint8)
            reqs.append(world.Irecv([buf, MPI.BYTE], source=target, tag=comm.tag))
            landing.append((ptr, nbytes, buf, stream))
        stream.enqueued += 1
    MPI.Request.Waitall(reqs)
    for ptr, nbytes, buf, stream in landing:
        _bytes_at(ptr, nbytes)[...] = buf
        stream.pending.append((ptr, nbytes))


def groupStart() -> None:
    _Nccl.group_depth += 1


def groupEnd() -> None:
    if _Nccl.group_depth == 0:
        raise DisciplineError("nccl.groupEnd() without a matching groupStart()")
    _Nccl.group_depth -= 1
    if _Nccl.group_depth == 0:
        items, _Nccl.queued = _Nccl.queued, []
        _run(items)


def _group_closed_at_exit() -> None:
    if _Nccl.group_depth:
        sys.stderr.write(f"DisciplineError: {_Nccl.group_depth} nccl.groupStart() never ended by groupEnd()\n")


atexit.register(_group_closed_at_exit)

_nccl = types.ModuleType(f"{__name__}.cuda.nccl")
for _name in ("NcclCommunicator", "get_unique_id", "groupStart", "groupEnd", "NCCL_UINT8", "DisciplineError"):
    setattr(_nccl, _name, globals()[_name])
_nccl.available = True  # type: ignore[attr-defined]
_nccl.state = _Nccl  # type: ignore[attr-defined]
_cuda.nccl = _nccl  # type: ignore[attr-defined]
cuda = _cuda
sys.modules[f"{__name__}.cuda"] = _cuda
sys.modules[f"{__name__}.cuda.runtime"] = _runtime
sys.modules[f"{__name__}.cuda.nccl"] = _nccl
uint8 = np.uint8
