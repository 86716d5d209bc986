"""The NCCL backend: one process per rank and GPU, CuPy shards, ``cupy.cuda.nccl`` transport.

    pip install -e ".[gpu]"                      # cupy-cuda12x and nvidia-nccl-cu12
    mpiexec -n 8 python train.py                 # chosen automatically when CUDA is usable
    MPIPAR_BACKEND=nccl mpiexec -n 8 python train.py

NOT RUN ON A GPU HERE: the machines this project is developed and tested on have no CUDA
device. CI runs this module's code through a stand-in for CuPy and NCCL
(``tests/nccl_standin``, used only by ``tests/mpi/test_nccl_standin.py``: NumPy arrays, recorded
streams, NCCL's calls carried over MPI, the backend's discipline checked);
``tests/mpi/test_gpu_nccl.py`` runs it on real GPUs where they exist.

Same interface and algorithms as the MPI backend (``mpipar.runtime.ordered``: every
reduction runs locally in group order, so results stay bit-identical to the simulator's),
with device transport:

* **One GPU per rank**, chosen by the local rank on its node (``MPI_LOCALRANKID`` from MPICH's
  hydra, ``OMPI_COMM_WORLD_LOCAL_RANK`` from Open MPI, ``SLURM_LOCALID``; otherwise the rank
  within an ``MPI_COMM_TYPE_SHARED`` split of the world) modulo the visible device count.
* **One NCCL communicator per rank group**, created on first use: member 0 calls
  ``nccl.get_unique_id()``, the id is broadcast over the group's MPI communicator, every
  member joins with ``NcclCommunicator(n, id, index)``. A world communicator, created when
  the backend starts, carries point-to-point ``exchange``.
* **A private CUDA stream** carries every NCCL call; a collective returns after
  ``stream.synchronize()``, which runs under the fault watchdog (``MPIPAR_TIMEOUT``); on
  expiry the watchdog aborts every NCCL communicator before ``MPI_Abort``.
* Uneven pieces: NCCL has no v-variants, so ``alltoallv``/``allgatherv``/``gatherv`` are
  grouped ``send``/``recv`` calls (``groupStart``/``groupEnd``) with exact byte counts;
  ``allGather`` is used when every piece has the same size. Data moves as ``NCCL_UINT8``.
* ``send``/``recv`` (buffered semantics: a send must not wait for its receive) stage through
  host memory over MPI; ``exchange`` stays on the GPU.
* Check mode and arrival notices travel over MPI, as in the MPI backend.
* Everything the MPI backend does with MPI's own calls on host buffers stays on the ordered
  path here, whose data moves through the NCCL transport above: the plain all-to-all,
  the in-place all-gather and the ordered reduce-scatter (an all-to-all, then the local
  reduction). ``MPIPAR_REDUCE=native`` has no effect: sums stay in group order.

CuPy is imported only when the backend starts, never at module import.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from mpipar.comm import Array, Completed, Group, Pending, PointToPoint, Shape, reduce_arrays, reduce_rows
from mpipar.runtime.faults import LEADER_HEAD_START_S
from mpipar.runtime.mpi import MPIBackend, MPICommunicator, MPIRuntime, runtime
from mpipar.runtime.ordered import OrderedCommunicator, _starts
from mpipar.spec import chunk_range

NCCL_UNIQUE_ID_BYTES = 128  # ncclUniqueId's size, fixed by nccl.h

LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _import_cupy(rank: int) -> Any:
    """CuPy, or a clear error saying why the NCCL backend cannot run here."""
    try:
        import cupy  # optional GPU dependency: never imported at module top
        from cupy.cuda import nccl

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device is visible")
        if not getattr(nccl, "available", True):
            raise RuntimeError("CuPy was built without NCCL")
    except Exception as exc:
        message = (
            f"the nccl backend needs CuPy with NCCL and a CUDA device, but: {exc} "
            "(install the extra: pip install -e '.[gpu]'; or run on CPUs with MPIPAR_BACKEND=mpi)"
        )
        if rank:  # every rank finds the same problem: let rank 0's report end the job alone
            time.sleep(LEADER_HEAD_START_S)
        raise RuntimeError(message) from None
    return cupy


def local_rank(world: Any) -> int:
    """This process's rank among the processes of its node (chooses its GPU)."""
    for var in LOCAL_RANK_VARS:
        raw = os.environ.get(var, "").strip()
        if raw.isdigit():
            return int(raw)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def pack_unique_id(raw: Any) -> np.ndarray:
    """NCCL's unique id as ``NCCL_UNIQUE_ID_BYTES`` int8 values and one byte saying its form, for
    the group's root to broadcast: CuPy 14 returns it as ``bytes``, earlier CuPy as a tuple of
    ints, and ``NcclCommunicator`` takes it back in the form ``get_unique_id`` gave it."""
    as_bytes = isinstance(raw, bytes | bytearray)
    # ncclUniqueId is ``char internal[128]``: a tuple holds its values as signed chars.
    values = np.frombuffer(bytes(raw), dtype=np.int8) if as_bytes else np.asarray(raw, dtype=np.int64).ravel()
    if values.shape != (NCCL_UNIQUE_ID_BYTES,) or not np.all((values >= -128) & (values <= 127)):
        raise RuntimeError(
            f"NCCL's unique id from CuPy is a {type(raw).__name__} of {values.size} values; expected "
            f"{NCCL_UNIQUE_ID_BYTES} bytes or signed chars (did CuPy's nccl.get_unique_id change form?)"
        )
    out = np.empty(NCCL_UNIQUE_ID_BYTES + 1, dtype=np.int8)
    out[:-1] = values.astype(np.int8)
    out[-1] = 1 if as_bytes else 0
    return out


def unpack_unique_id(packed: np.ndarray) -> bytes | tuple[int, ...]:
    """The unique id ``pack_unique_id`` packed, in the form CuPy gave it (bytes, or a tuple of ints)."""
    values = packed[:-1]
    return values.tobytes() if packed[-1] else tuple(int(x) for x in values)


class NCCLCommunicator(MPICommunicator):
    """NCCL transport for the ordered collectives (see the module docstring)."""

    name = "nccl"

    def __init__(self, rt: MPIRuntime) -> None:
        super().__init__(rt)
        cupy = _import_cupy(rt.rank)
        from cupy.cuda import nccl

        self._cp = cupy
        self._nccl_mod = nccl
        self.device = local_rank(rt.world) % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(self.device).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.native_sums = False  # MPI's native sums would be handed device buffers
        # The default agreement check rides on host messages of the MPI transport; device
        # buffers would need their own trailer handling (MPIPAR_CHECK_COLLECTIVES=1 works here).
        self.agree = False
        self._groups: dict[Group, Any] = {}
        self._reduction_stream: Any = None  # created on the first started all-reduce
        rt.watchdog.on_expire.append(self._abort_all)
        self._world = self._nccl_for(tuple(range(rt.size)))

    @property
    def xp(self) -> Any:
        return self._cp

    # ------------------------------------------------------------------ plumbing
    def _nccl_for(self, group: Group) -> Any:
        """The cached NCCL communicator of ``group`` (member i = its NCCL rank i)."""
        comm = self._groups.get(group)
        if comm is None:
            mpi_comm = self._rt.comm_for(group)
            uid = np.zeros(NCCL_UNIQUE_ID_BYTES + 1, dtype=np.int8)
            if group.index(self.rank) == 0:
                uid[:] = pack_unique_id(self._nccl_mod.get_unique_id())
            with self._rt.watchdog.watch("creating the group's NCCL communicator", group, 0):
                mpi_comm.Ibcast([uid, MPI.BYTE], root=0).Wait()
                comm = self._nccl_mod.NcclCommunicator(len(group), unpack_unique_id(uid), group.index(self.rank))
            self._groups[group] = comm
        return comm

    def _abort_all(self) -> None:
        for comm in self._groups.values():
            with contextlib.suppress(Exception):
                comm.abort()

    def _sync(self) -> None:
        """Wait for the stream (inside the caller's watchdog context)."""
        self.stream.synchronize()

    def _flat(self, a: Array, dtype: Any) -> Array:
        cp = self._cp
        return cp.ascontiguousarray(cp.asarray(a, dtype=dtype)).reshape(-1)

    def _u8(self, a: Array) -> Array:
        return a.reshape(-1).view(self._cp.uint8)

    def _p2p(self, comm: Any, sends: Sequence[tuple[Array, int]], recvs: Sequence[tuple[Array, int]]) -> None:
        """One NCCL group of sends ``(uint8 buffer, peer)`` and receives; then wait."""
        self._p2p_enqueue(comm, sends, recvs, self.stream)
        self._sync()

    def _p2p_enqueue(
        self, comm: Any, sends: Sequence[tuple[Array, int]], recvs: Sequence[tuple[Array, int]], on: Any
    ) -> None:
        """One NCCL group of sends and receives enqueued on stream ``on`` (no wait)."""
        u8 = self._nccl_mod.NCCL_UINT8
        stream = on.ptr
        self._nccl_mod.groupStart()
        try:
            for buf, peer in sends:
                if buf.size:
                    comm.send(buf.data.ptr, buf.size, u8, peer, stream)
            for buf, peer in recvs:
                if buf.size:
                    comm.recv(buf.data.ptr, buf.size, u8, peer, stream)
        finally:
            self._nccl_mod.groupEnd()

    # ------------------------------------------------------------------ transport
    # The MPI backend's versions of these call MPI on the buffers; device buffers take the
    # ordered path's, built on the transport methods below.
    _t_alltoall = OrderedCommunicator._t_alltoall
    _t_allgather_in_place = OrderedCommunicator._t_allgather_in_place
    _scatter_reduce = OrderedCommunicator._scatter_reduce

    def bound_all_reduce(self, group: Group, shape: Shape, dtype: Any, op: str) -> None:
        """None: the MPI backend's bound all-reduce hands the buffer to MPI's ``Allgather`` and
        folds into a host (NumPy) array, which device shards must not take (MPI would read GPU
        memory, and NCCL would carry nothing). A captured program keeps the general
        ``all_reduce`` here, whose data moves through NCCL, as eager's does."""
        return None

    # ------------------------------------------------------------------ started all-reduce
    def _all_reduce_start(self, group: Group, bufs: Any, op: str) -> Pending:
        """The ordered all-reduce enqueued whole on the reduction stream, without waiting: the
        exchange of ranges (or, small, of whole buffers), the local reduction in group order,
        and the all-gather of the ranges run there in stream order while backward's kernels
        run on the compute stream. ``wait`` synchronises the reduction stream under the
        watchdog. The same kernels as the blocking path, so the same bits."""
        cp = self._cp
        a = self._mine("all_reduce", group, bufs)
        n, i = len(group), group.index(self.rank)
        if n == 1:
            return Completed({self.rank: reduce_arrays([a], op, cp)})
        seq = self._number(group, "all_reduce", dtype=a.dtype, reduce_type=op, shape=tuple(a.shape))
        comm, u8 = self._nccl_for(group), self._nccl_mod.NCCL_UINT8
        if self._reduction_stream is None:
            self._reduction_stream = cp.cuda.Stream(non_blocking=True)
        on = self._reduction_stream
        # The gradient was written on the compute stream: the reduction waits for that work.
        on.wait_event(cp.cuda.get_current_stream().record())
        keep: list[Any] = [a]
        with on:
            flat = self._flat(a, a.dtype)
            size = flat.size
            keep.append(flat)
            if self.gathers_whole(size, n, flat.itemsize):
                rows = cp.empty(n * size, dtype=flat.dtype)
                keep.append(rows)
                if size:
                    comm.allGather(self._u8(flat).data.ptr, self._u8(rows).data.ptr, flat.nbytes, u8, on.ptr)
                out = reduce_rows(rows.reshape(n, size), op, cp)
            else:
                lengths = tuple(e - s for s, e in (chunk_range(size, n, j) for j in range(n)))
                starts = _starts(lengths)
                mine = lengths[i]
                rows = cp.empty(n * mine, dtype=flat.dtype)
                out = cp.empty(size, dtype=flat.dtype)
                keep.append(rows)
                rows[i * mine : (i + 1) * mine] = flat[starts[i] : starts[i + 1]]
                peers = [j for j in range(n) if j != i]
                self._p2p_enqueue(
                    comm,
                    [(self._u8(flat[starts[j] : starts[j + 1]]), j) for j in peers],
                    [(self._u8(rows[j * mine : (j + 1) * mine]), j) for j in peers],
                    on,
                )
                reduce_rows(rows.reshape(n, mine), op, cp, out=out[starts[i] : starts[i + 1]])
                if _uniform(lengths):
                    comm.allGather(
                        self._u8(out[starts[i] : starts[i + 1]]).data.ptr,
                        self._u8(out).data.ptr,
                        mine * out.itemsize,
                        u8,
                        on.ptr,
                    )
                else:
                    self._p2p_enqueue(
                        comm,
                        [(self._u8(out[starts[i] : starts[i + 1]]), j) for j in peers],
                        [(self._u8(out[starts[j] : starts[j + 1]]), j) for j in peers],
                        on,
                    )
        return _StreamAllReduce(self, on, group, seq, out.reshape(a.shape), keep)

    def _t_alltoallv(
        self, group: Group, send: Array, scounts: Sequence[int], recv: Array, rcounts: Sequence[int]
    ) -> None:
        comm, i = self._nccl_for(group), group.index(self.rank)
        s8, r8 = self._u8(send), self._u8(recv)
        sd, rd = _offsets(scounts, send.itemsize), _offsets(rcounts, recv.itemsize)
        sends, recvs = [], []
        for j in range(len(group)):
            src = s8[sd[j] : sd[j + 1]]
            dst = r8[rd[j] : rd[j + 1]]
            if j == i:
                with self.stream:
                    dst[...] = src
            else:
                sends.append((src, j))
                recvs.append((dst, j))
        self._p2p(comm, sends, recvs)

    def _t_allgatherv(self, group: Group, send: Array, recv: Array, counts: Sequence[int]) -> None:
        comm, i = self._nccl_for(group), group.index(self.rank)
        s8, r8 = self._u8(send), self._u8(recv)
        if len(set(counts)) == 1:
            if counts[0]:
                comm.allGather(s8.data.ptr, r8.data.ptr, s8.size, self._nccl_mod.NCCL_UINT8, self.stream.ptr)
                self._sync()
            return
        rd = _offsets(counts, recv.itemsize)
        with self.stream:
            r8[rd[i] : rd[i + 1]] = s8
        peers = [j for j in range(len(group)) if j != i]
        self._p2p(comm, [(s8, j) for j in peers], [(r8[rd[j] : rd[j + 1]], j) for j in peers])

    def _t_gatherv(self, group: Group, root: int, send: Array, recv: Array | None, counts: Sequence[int]) -> None:
        comm, i = self._nccl_for(group), group.index(self.rank)
        s8 = self._u8(send)
        if recv is None:
            self._p2p(comm, [(s8, root)], [])
            return
        r8 = self._u8(recv)
        rd = _offsets(counts, recv.itemsize)
        with self.stream:
            r8[rd[i] : rd[i + 1]] = s8
        self._p2p(comm, [], [(r8[rd[j] : rd[j + 1]], j) for j in range(len(group)) if j != i])

    def _t_bcast(self, group: Group, buf: Array, root: int) -> None:
        b8 = self._u8(buf)
        if b8.size:
            self._nccl_for(group).bcast(b8.data.ptr, b8.size, self._nccl_mod.NCCL_UINT8, root, self.stream.ptr)
            self._sync()

    def _t_barrier(self, group: Group) -> None:
        self._sync()
        super()._t_barrier(group)

    # ------------------------------------------------------------------ point to point
    def _exchange(self, transfers: Sequence[PointToPoint], hosted: set[int]) -> dict[tuple[int, int, int], Array]:
        cp = self._cp
        self._reap()
        sends: list[tuple[Array, int]] = []
        recvs: list[tuple[Array, int]] = []
        out: dict[tuple[int, int, int], Array] = {}
        peers: set[int] = set()
        # NCCL has no tags: messages between a pair match in posting order, which is the
        # plan's piece order on both sides.
        for t in transfers:
            if t.src == self.rank:
                if t.data is None or tuple(t.data.shape) != tuple(t.shape):
                    got = "no data" if t.data is None else f"shape {list(t.data.shape)}"
                    raise RuntimeError(
                        f"transfer {t.src} -> {t.dst} (tag {t.tag}): the sender has {got}, expected {list(t.shape)}"
                    )
                sends.append((self._u8(self._flat(t.data, t.dtype)), t.dst))
                peers.add(t.dst)
            elif t.dst == self.rank:
                buf = cp.empty(t.shape, dtype=t.dtype)
                out[(t.src, t.dst, t.tag)] = buf
                recvs.append((self._u8(buf), t.src))
                peers.add(t.src)
        if not peers:
            return out
        self._exchanges += 1
        group = tuple(sorted(peers | {self.rank}))
        with self._rt.watchdog.watch(
            f"point-to-point exchange with ranks {sorted(peers)}", group, self._exchanges, p2p=True
        ):
            self._p2p(self._world, sends, recvs)
        return out

    def _send(self, src: int, dst: int, buf: Array, tag: int) -> None:
        super()._send(src, dst, self._cp.asnumpy(buf), tag)

    def _recv(self, src: int, dst: int, shape: Shape, dtype: np.dtype, tag: int) -> Array:
        return self._cp.asarray(super()._recv(src, dst, shape, dtype, tag))

    def _recv_buffer(self, shape: Shape, dtype: np.dtype) -> np.ndarray:
        """A host buffer: MPI moves host memory (the MPI wheel is not CUDA-aware), and ``_result``
        here would hand it a device buffer; ``_recv`` copies the message to the device after."""
        return np.empty(shape, dtype=dtype)


class _StreamAllReduce(Pending):
    """A started all-reduce enqueued on the reduction stream (``NCCLCommunicator._all_reduce_start``)."""

    def __init__(
        self, owner: NCCLCommunicator, stream: Any, group: Group, seq: int, out: Array, keep: list[Any]
    ) -> None:
        self.owner, self.stream, self.group, self.seq, self.out = owner, stream, group, seq, out
        self.keep: list[Any] | None = keep  # buffers the stream still reads: not freed before it is done

    def test(self) -> bool:
        return bool(self.stream.done)

    def wait(self) -> dict[int, Array]:
        if self.keep is not None:
            with self.owner._rt.watchdog.watch("all_reduce started on the reduction stream", self.group, self.seq):
                self.stream.synchronize()
            self.keep = None
        return {self.owner.rank: self.out}


def _uniform(counts: Sequence[int]) -> bool:
    return counts.count(counts[0]) == len(counts)


def _offsets(counts: Sequence[int], itemsize: int) -> list[int]:
    """Byte offsets of pieces of these element counts packed back to back, and the end."""
    return [s * itemsize for s in _starts(tuple(counts))]


_communicator: NCCLCommunicator | None = None


class NCCLBackend(MPIBackend):
    """One process per rank and GPU; CuPy shards; NCCL collectives (see the module docstring)."""

    name = "nccl"

    def __init__(self) -> None:
        global _communicator
        self._rt = runtime()
        if _communicator is None:
            _communicator = NCCLCommunicator(self._rt)
        self._nccl_comm = _communicator

    @property
    def comm(self) -> NCCLCommunicator:  # type: ignore[override]
        return self._nccl_comm

    @property
    def xp(self) -> Any:
        return self._nccl_comm.xp

    def describe(self) -> str:
        return f"nccl: rank {self._rt.rank} of {self._rt.size} on GPU {self._nccl_comm.device}"
