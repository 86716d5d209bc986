"""Per-rank programs: ``python -m simulator -n N script.py`` for a script written in manual mode.

Each virtual rank runs the whole script in its own thread, with ``dist.get_rank()`` returning
that rank, the way ``mpiexec -n N`` runs it in N processes. The threads take turns: exactly one
runs at a time, until it blocks in a communication call (a collective whose members have not
all arrived, a ``recv`` with nothing sent yet); the next rank that can make progress then runs.
Taking turns instead of running freely is what makes this a debugger rather than a second
MPI:

* runs are deterministic (the same interleaving every time), and the process-wide state the
  library keeps (the random generator's counter, grad mode, the comm context) and NumPy's and
  Python's global generators are saved and restored at every switch, so each rank sees only
  its own, as each process does under ``mpiexec``;
* a deadlock is detected exactly, not by a timeout: when the running rank blocks and no
  other rank can move, every rank's pending call is known, and the report names them;
* a collective mismatch (rank 0 in all_reduce, rank 1 in all_gather on the same group, or
  the same call with different shapes/dtypes/roots) is reported when the second rank
  arrives, naming both ranks, both calls and the group.

Collectives are matched per group in call order (the k-th call of each member on a group
meets the k-th call of the others, as MPI matches them). The rank that completes a
collective runs it through one ``VirtualCommunicator`` call with every member's buffer, so
``CommDebugMode``, traced plans and measured timelines see one event per collective, exactly
as for a semi-automatic program. ``send`` is buffered (it returns at once); ``recv`` waits.

Distributed tensors in the same script: every thread hosts all ranks of every mesh (the
semi-automatic machinery is unchanged), ``local_tensor()`` without a rank returns the
running rank's shard, and ``dtensor_from_local(local, ...)`` gathers the pieces of the
mesh's ranks from their threads. The semi-automatic work is repeated in every thread (a
cost of N per step, acceptable for debugging); its communication is recorded from rank 0's
thread only, so counts are those of one copy.
"""

from __future__ import annotations

import io
import random
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from mpipar import comm
from mpipar import random as mp_random
from mpipar.autograd import is_grad_enabled, set_grad_mode
from mpipar.comm import Array, Communicator, Shape
from mpipar.mesh import ProcessMesh
from simulator.backend import SimBackend
from simulator.virtual_comm import VirtualCommunicator

Group = tuple[int, ...]

_local = threading.local()


class ManualModeError(RuntimeError):
    """A per-rank program went wrong: a deadlock, a mismatched collective, a rank that failed."""


class _Abort(BaseException):
    """Unwinds a rank's program after another rank ended the run (not an error of this rank)."""


@dataclass
class _Wait:
    """What a blocked rank waits for, and how to say so in a deadlock report."""

    describe: Callable[[], str]
    ready: Callable[[], bool]


@dataclass
class _Slot:
    """One collective call on one group while its members arrive."""

    group: Group
    seq: int
    calls: dict[int, str] = field(default_factory=dict)
    payload: dict[int, Any] = field(default_factory=dict)
    arrived: dict[int, float] = field(default_factory=dict)
    results: dict[int, Any] | None = None


def _sig(a: Array) -> str:
    return f"{np.dtype(a.dtype)}{list(a.shape)}"


def _fresh_state() -> tuple[Any, ...]:
    return (True, mp_random.get_rng_state(), [], np.random.get_state(), random.getstate())


class PerRankWorld:
    """N rank programs taking turns, with their collectives matched (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.n = world_size
        self.cv = threading.Condition()
        self.turn: int | None = None
        self.state = ["ready"] * world_size
        self.waits: dict[int, _Wait] = {}
        self.saved: dict[int, tuple[Any, ...]] = {}
        self.stopped = False
        self.error: BaseException | None = None
        self.slots: dict[tuple[Group, int], _Slot] = {}
        self.seq: dict[tuple[int, Group], int] = defaultdict(int)
        self.manual = _ManualComm()
        self._initial: tuple[Any, ...] = _fresh_state()

    # ------------------------------------------------------------------ process-wide state
    @staticmethod
    def _capture() -> tuple[Any, ...]:
        # NumPy's and Python's global generators too: a script that seeds ``np.random`` and draws
        # its data from it (the seeds' datasets do) has one stream per process under mpiexec.
        return (
            is_grad_enabled(),
            mp_random.get_rng_state(),
            list(comm._context),
            np.random.get_state(),
            random.getstate(),
        )

    @staticmethod
    def _restore(saved: tuple[Any, ...]) -> None:
        grad, rng, context, np_state, py_state = saved
        set_grad_mode(grad)
        mp_random.set_rng_state(rng)
        comm._context[:] = context
        np.random.set_state(np_state)
        random.setstate(py_state)

    # ------------------------------------------------------------------ turns
    def _pass_turn(self, after: int) -> None:
        """Give the turn to the next rank that can move; detect a deadlock if none can (lock held)."""
        for step in range(1, self.n + 1):
            c = (after + step) % self.n
            if self.state[c] == "ready" or (self.state[c] == "blocked" and self.waits[c].ready()):
                self.turn = c
                self.cv.notify_all()
                return
        self.turn = None
        if any(s == "blocked" for s in self.state):
            self._stop(ManualModeError(self._deadlock_report()))
        self.cv.notify_all()

    def _deadlock_report(self) -> str:
        lines = ["deadlock in the per-rank programs: every rank still running waits for a call no rank will make"]
        for r in range(self.n):
            if self.state[r] == "blocked":
                lines.append(f"  rank {r}: {self.waits[r].describe()}")
            else:
                lines.append(f"  rank {r}: {'finished' if self.state[r] == 'done' else self.state[r]}")
        lines.append("under mpiexec this program would hang here")
        return "\n".join(lines)

    def _stop(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.stopped = True
        self.turn = None
        self.cv.notify_all()

    def block(self, rank: int, wait: _Wait) -> None:
        """Let other ranks run until ``wait`` is ready (the caller holds the turn)."""
        if wait.ready():
            return
        with self.cv:
            self.saved[rank] = self._capture()
            self.state[rank] = "blocked"
            self.waits[rank] = wait
            self._pass_turn(rank)
            while self.turn != rank and not self.stopped:
                self.cv.wait()
            if self.stopped:
                raise _Abort
            self.state[rank] = "running"
            del self.waits[rank]
            self._restore(self.saved.pop(rank))

    # ------------------------------------------------------------------ running
    def _main(self, rank: int, program: Callable[[], None]) -> None:
        _local.rank = rank
        with self.cv:
            while self.turn != rank and not self.stopped:
                self.cv.wait()
            if self.stopped:
                return
            self.state[rank] = "running"
            self._restore(self._initial)
        failure: BaseException | None = None
        try:
            program()
        except _Abort:
            return
        except SystemExit as exc:
            if exc.code not in (None, 0):
                failure = ManualModeError(f"rank {rank} exited with {exc.code}")
        except BaseException as exc:  # any failure of a rank ends the run, as MPI_Abort does
            failure = exc
            failure.add_note(f"(raised in the program of rank {rank})")
        with self.cv:
            if failure is not None:
                self.state[rank] = "failed"
                self._stop(failure)
            else:
                self.state[rank] = "done"
                self._pass_turn(rank)

    def run(self, program: Callable[[], None]) -> None:
        """Run ``program`` once per rank; raise the first failure, a mismatch or a deadlock report."""
        self._initial = _fresh_state()
        threads = [
            threading.Thread(target=self._main, args=(r, program), name=f"rank-{r}", daemon=True) for r in range(self.n)
        ]
        for t in threads:
            t.start()
        with self.cv:
            self.turn = 0
            self.cv.notify_all()
            while not self.stopped and any(s not in ("done", "failed") for s in self.state):
                self.cv.wait(timeout=1.0)
        for t in threads:
            t.join(timeout=5.0)
        if self.error is not None:
            raise self.error
        unreceived = self.manual.pending()
        if unreceived:
            raise ManualModeError(
                "messages sent but never received: "
                + ", ".join(f"rank {s} -> rank {d}" for s, d, _ in unreceived)
                + "; under mpiexec the receivers would miss them (add the matching recv)"
            )

    # ------------------------------------------------------------------ matching
    def collective(
        self,
        rank: int,
        call: str,
        group: Group,
        detail: str,
        payload: Any,
        compute: Callable[[dict[int, Any]], Mapping[int, Any]],
        label: str | None = None,
    ) -> Any:
        """Join the next call on ``group``; the last member to arrive runs ``compute`` for all.
        ``label`` names the members' timeline spans as the MPI communicator names them (default:
        the call and its reduce op, ``all_reduce(sum)``)."""
        seq = self.seq[(rank, group)]
        self.seq[(rank, group)] = seq + 1
        slot = self.slots.setdefault((group, seq), _Slot(group, seq))
        mine = f"{call}{detail}"
        for other, theirs in slot.calls.items():
            if theirs != mine:
                raise ManualModeError(
                    f"collective mismatch on group {list(group)} (call #{seq + 1} on that group): rank {other} "
                    f"calls {theirs}, rank {rank} calls {mine}; every member must make the same call with "
                    "the same shapes, dtype, op and root"
                )
            break
        slot.calls[rank] = mine
        slot.payload[rank] = payload
        slot.arrived[rank] = comm.span_clock() if comm._span_recorders else 0.0
        if len(slot.payload) == len(group):
            del self.slots[(group, seq)]
            slot.results = dict(compute(slot.payload))
            # one span per member, from its arrival: a timeline shows who waited for whom
            span = f"{label or mine.split(' ')[0]} on {list(group)}"
            for r in group:
                Communicator._span(span, (r,), slot.arrived[r])
        else:

            def describe() -> str:
                missing = [r for r in group if r not in slot.payload]
                return (
                    f"{mine} on group {list(group)} (call #{seq + 1} on that group), waiting for rank(s) "
                    f"{missing} to make the same call"
                )

            self.block(rank, _Wait(describe, lambda: slot.results is not None))
        assert slot.results is not None
        return slot.results[rank]

    def recv(self, rank: int, src: int, shape: Shape, dtype: np.dtype) -> Array:
        box = (src, rank, 0)
        start = comm.span_clock() if comm._span_recorders else 0.0
        self.block(
            rank,
            _Wait(
                lambda: f"recv {np.dtype(dtype)}{list(shape)} from rank {src}: rank {src} never sends it",
                lambda: bool(self.manual._mailbox.get(box)),
            ),
        )
        try:
            value = self.manual._recv(src, rank, tuple(shape), np.dtype(dtype), 0)
        except RuntimeError as exc:
            raise ManualModeError(f"send/recv mismatch: {exc}") from None
        Communicator._span(f"recv from {src}", (rank,), start, "RECV", src)  # the wait included
        return value


class _ManualComm(VirtualCommunicator):
    """Manual collectives' communicator: events as usual; spans come from ``PerRankWorld``
    (per member, from its arrival), not from the one call that computes them all."""

    @classmethod
    def _span_group(cls, label: str, group: Any, hosted: Any, start: float) -> None:
        return None


class _Transport:
    """The ``ManualTransport`` of one rank's program (see ``mpipar.comm``)."""

    def __init__(self, world: PerRankWorld, rank: int, call: str) -> None:
        self.world, self.me, self.call = world, rank, call
        self.comm = world.manual

    def _run(
        self,
        group: Group,
        detail: str,
        payload: Any,
        compute: Callable[[dict[int, Any]], Mapping[int, Any]],
        label: str | None = None,
    ) -> Any:
        try:
            return self.world.collective(self.me, self.call, group, detail, payload, compute, label)
        except RuntimeError as exc:
            if isinstance(exc, ManualModeError):
                raise
            raise ManualModeError(f"{self.call} on group {list(group)}: {exc}") from None

    def all_reduce(self, group: Group, buf: Array, op: str) -> Array:
        return self._run(group, f"({op}) {_sig(buf)}", buf, lambda b: self.comm.all_reduce(group, b, op))

    def all_gather(self, group: Group, buf: Array) -> list[Array]:
        return self._run(
            group, f" {_sig(buf)}", buf, lambda b: self.comm.all_gather(group, b, [tuple(b[r].shape) for r in group])
        )

    def reduce_scatter(self, group: Group, chunks: Sequence[Array], op: str) -> Array:
        sig = f"({op}) " + ", ".join(_sig(c) for c in chunks)
        return self._run(group, sig, list(chunks), lambda b: self.comm.reduce_scatter(group, b, op))

    def all_to_all(self, group: Group, chunks: Sequence[Array], recv_shapes: Sequence[Shape]) -> list[Array]:
        dtype = np.dtype(chunks[0].dtype) if chunks else None
        payload = (list(chunks), list(recv_shapes))

        def compute(b: dict[int, Any]) -> Mapping[int, Any]:
            return self.comm.all_to_all(group, {r: v[0] for r, v in b.items()}, {r: v[1] for r, v in b.items()})

        return self._run(group, f" {dtype}", payload, compute)

    def broadcast(self, group: Group, buf: Array, root: int) -> Array:
        return self._run(
            group,
            f" {_sig(buf)} from rank {root}",
            buf,
            lambda b: self.comm.broadcast(group, b, root, tuple(b[root].shape), b[root].dtype),
            f"broadcast(root {root})",
        )

    def reduce(self, group: Group, buf: Array, op: str, root: int) -> Array | None:
        def compute(b: dict[int, Any]) -> Mapping[int, Any]:
            out = self.comm.reduce(group, b, op, root)
            return {r: out.get(r) for r in group}

        return self._run(  # type: ignore[no-any-return]
            group, f"({op}) {_sig(buf)} to rank {root}", buf, compute, f"reduce({op}, root {root})"
        )

    def barrier(self, group: Group) -> None:
        def compute(b: dict[int, Any]) -> Mapping[int, Any]:
            self.comm.barrier(group)
            return {r: None for r in group}

        self._run(group, "", None, compute)

    def send(self, dst: int, buf: Array) -> None:
        self.comm.send(self.me, dst, buf)

    def recv(self, src: int, shape: Shape, dtype: np.dtype) -> Array:
        return self.world.recv(self.me, src, shape, dtype)

    def assemble(self, group: Group, local: Array) -> dict[int, Array]:
        """Every member gets all members' local arrays (no communication is recorded: the
        semi-automatic program would hold them all in one process)."""
        return self._run(group, " (dtensor_from_local)", local, lambda b: {r: dict(b) for r in group})


class _RankZeroRecords(VirtualCommunicator):
    """The semi-automatic communicator of per-rank threads: every thread repeats the same
    work, so only rank 0's thread reports it (counts are those of one copy)."""

    def _record(self, *args: Any, **kwargs: Any) -> None:
        if getattr(_local, "rank", 0) == 0:
            super()._record(*args, **kwargs)

    @classmethod
    def _span_group(cls, label: str, group: Any, hosted: Any, start: float) -> None:
        if getattr(_local, "rank", 0) == 0:
            super()._span_group(label, group, hosted, start)


class PerRankBackend(SimBackend):
    """The simulator backend seen by per-rank programs: ``rank`` is the running thread's."""

    name = "sim"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.world = PerRankWorld(world_size)
        self._comm: Communicator = _RankZeroRecords()

    @property
    def rank(self) -> int:
        return int(getattr(_local, "rank", 0))

    @property
    def program_rank(self) -> int:
        """The rank whose program is running (``Tensor.local_tensor()`` without a rank uses it)."""
        return self.rank

    def manual_transport(self, call: str) -> _Transport:
        return _Transport(self.world, self.rank, call)

    def assemble_locals(self, mesh: ProcessMesh, local: Array) -> dict[int, Array]:
        """``dtensor_from_local`` of one rank's piece: the pieces of all of ``mesh``'s ranks."""
        members = tuple(mesh.process_ids)
        if self.rank not in members:
            return {}
        return _Transport(self.world, self.rank, "dtensor_from_local").assemble(members, local)

    def describe(self) -> str:
        return f"simulator, one program per rank (world size {self.world_size})"


class _RankPrefixer(io.TextIOBase):
    """Lines written by ranks other than 0 get ``[rank N] `` in front, as under ``mpiexec``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._partial: dict[int, str] = defaultdict(str)

    def write(self, text: str) -> int:
        rank = int(getattr(_local, "rank", 0))
        data = self._partial[rank] + text
        lines = data.split("\n")
        self._partial[rank] = lines.pop()
        prefix = f"[rank {rank}] " if rank else ""
        for line in lines:
            self.stream.write(f"{prefix}{line}\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def run_per_rank(program: Callable[[], None], backend: PerRankBackend) -> None:
    """Run ``program`` as every rank's program under ``backend`` (output prefixed per rank)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RankPrefixer(sys.stdout), _RankPrefixer(sys.stderr)  # type: ignore[assignment]
    try:
        backend.world.run(program)
    finally:
        for s in (sys.stdout, sys.stderr):
            for rank, rest in list(s._partial.items()):  # type: ignore[attr-defined]
                if rest:
                    s.stream.write(f"{f'[rank {rank}] ' if rank else ''}{rest}\n")  # type: ignore[attr-defined]
        sys.stdout, sys.stderr = saved
        sys.stdout.flush()
