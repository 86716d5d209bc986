"""Faults never hang: abort on exceptions, timeouts that name the missing ranks, a check mode.

Under MPI one rank's failure would leave the others blocked in their next collective
forever. This module turns every such case into a prompt, explained end of the job:

* **An exception on any rank** (``install_excepthook``): the traceback is printed once (with
  the ``[rank N]`` prefix) and ``MPI.COMM_WORLD.Abort(1)`` ends every rank; the mpich wheel's
  hydra launcher then exits non-zero within about a second.
* **A rank killed by a signal** (SIGKILL, OOM killer): hydra itself notices the dead process
  and kills the rest ("BAD TERMINATION ... EXIT CODE: 9", about a second here), so no
  watchdog of ours is needed for it (``tests/mpi/test_mpi_faults.py`` pins that).
* **A collective that never completes** (``Watchdog``): every blocking wait of the MPI and
  NCCL communicators runs inside ``Watchdog.watch(op, group, seq)``. A daemon thread looks at
  the current wait a few times a second. After ``grace`` seconds it posts an *arrival notice*
  ("rank r waits in op on group g, call #seq") to every rank on a private communicator; after
  ``MPIPAR_TIMEOUT`` seconds (default 300) it reads the notices it has received and aborts
  with the op, the group and the ranks that never arrived, and says what each of those was
  last seen doing (waiting in another collective, finished the script, or silent). A rank
  that finishes the script posts an "exited" notice, so its group mates fail within seconds
  instead of waiting out the timeout.
* **Mismatched collectives** (``MPIPAR_CHECK_COLLECTIVES=1``): before each collective the
  members exchange signatures (op, reduce op, dtype, shapes) and ``compare_signatures``
  reports a difference as a ``CollectiveMismatchError`` naming each rank and what it issued.

Why a watchdog thread and not a ``Test`` loop with a deadline: with 8 ranks on 2 cores a
Python polling loop starves the ranks that have work (a polled collective takes many times
as long as one that waits in ``Wait``), and MPICH progresses non-blocking collectives only
while some call polls. So the main thread blocks in ``Waitall`` on the non-blocking
request, at full speed, and the deadline lives in a thread that wakes every 100 ms and costs
nothing while the job is healthy. The thread makes MPI calls while the main thread waits,
which mpi4py's default ``MPI_THREAD_MULTIPLE`` allows; at a lower thread level the watchdog
still aborts on time but cannot name the missing ranks.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mpipar.env import env_flag, env_number
from mpipar.runtime.log import flush_std_streams

DEFAULT_TIMEOUT_S = 300.0
EXIT_GRACE_S = 5.0
"""How long a wait may go on after a member of its group has finished the script."""
LEADER_HEAD_START_S = 5.0
"""How long other ranks let the first arrived rank report a timeout or mismatch alone."""
NOTICE_TAG = 7
RANK_ERROR_DELAY_S = 1.0
"""How long a rank other than 0 waits before printing its uncaught exception."""


class CollectiveMismatchError(RuntimeError):
    """Members of a group issued different collectives (``MPIPAR_CHECK_COLLECTIVES=1``)."""


# ------------------------------------------------------------------------------ settings
def timeout_from_env(env: Mapping[str, str] | None = None) -> float:
    """``MPIPAR_TIMEOUT`` in seconds (default 300): how long any one collective may take."""
    return env_number("MPIPAR_TIMEOUT", DEFAULT_TIMEOUT_S, minimum=0.0, strict=True, unit="seconds", env=env)


def check_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``MPIPAR_CHECK_COLLECTIVES``: 1/true/yes/on enables the signature check."""
    return env_flag("MPIPAR_CHECK_COLLECTIVES", False, env)


def agree_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``MPIPAR_AGREE`` (default on): check each collective's signature through its own messages."""
    return env_flag("MPIPAR_AGREE", True, env)


class CollectiveDesyncError(RuntimeError):
    """An MPI call failed inside a collective: almost always ranks that issued different calls.

    Without check mode the members of a group exchange no signatures, so a rank that skips or
    reorders a collective surfaces as whatever MPI notices first (typically "Message
    truncated": one member's buffer size disagrees with another's). The message keeps MPI's
    first line and says how to get the rank-by-rank comparison.
    """

    def __init__(self, waiting: Waiting, error: BaseException, rank: int) -> None:
        text = str(error).strip().splitlines()
        first = text[0] if text else type(error).__name__
        last = text[-1].split(":", 1)[-1].strip() if len(text) > 1 else ""
        detail = f"{first}" + (f" ({last})" if last and last not in first else "")
        super().__init__(
            f"rank {rank}: MPI failed in {waiting.op} on group {list(waiting.group)} (call #{waiting.seq} there): "
            f"{detail}. This usually means the ranks of the group issued different collectives, or the same "
            "collective with different shapes or dtypes (a rank skipped, added or reordered one). Rerun with "
            "MPIPAR_CHECK_COLLECTIVES=1: every collective then compares what each member issued and names the "
            "rank that differs."
        )
        self.op = waiting.op
        self.group = waiting.group
        self.rank = rank


# ------------------------------------------------------------------------------ excepthook
def install_excepthook(abort: Callable[[], None], rank: int = 0) -> None:
    """On an uncaught exception: print the traceback once, then ``abort()`` the whole job.

    Ranks other than 0 wait ``RANK_ERROR_DELAY_S`` before printing: when every rank hits the
    same error (a bad mesh, a missing dependency), rank 0's abort ends the others first and
    the traceback shows once; an error on one rank alone is still reported, a second later.
    """
    previous = sys.excepthook
    if getattr(previous, "_mpipar_abort_hook", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            if rank:
                time.sleep(RANK_ERROR_DELAY_S)
            previous(exc_type, exc, tb)
        finally:
            flush_std_streams()
            abort()

    hook._mpipar_abort_hook = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# ------------------------------------------------------------------------------ signatures
def _shape_text(dtype: str, shape: Sequence[int]) -> str:
    return f"{dtype}{list(shape)}"


def signature(op: str, *, dtype: Any, reduce_type: str | None = None, **parts: Any) -> dict[str, Any]:
    """The record members of a group compare before a collective in check mode.

    ``parts`` are the op's shape facts: ``shape`` (all_reduce, reduce, broadcast), ``shapes``
    (all_gather: every member's piece; reduce_scatter: the chunk row), ``sends``/``recvs``
    (all_to_all: the shapes this member sends to / expects from each member), ``root``.
    Everything but ``sends``/``recvs`` must be equal on every member.
    """
    label = f"{op}({reduce_type})" if reduce_type else op
    common = {"op": op, "reduce_type": reduce_type, "dtype": str(dtype)}
    common.update({k: _jsonable(v) for k, v in parts.items() if k not in ("sends", "recvs")})
    sig: dict[str, Any] = {"common": common, "desc": call_text(op, dtype, reduce_type, parts), "label": label}
    for k in ("sends", "recvs"):
        if k in parts:
            sig[k] = _jsonable(parts[k])
    return sig


def call_text(op: str, dtype: Any, reduce_type: str | None, parts: Mapping[str, Any]) -> str:
    """A collective in words: ``all_reduce(sum) of float64[4, 3]``, ``all_gather of float32 pieces [...]``."""
    label = f"{op}({reduce_type})" if reduce_type else op
    dt = str(dtype)
    if "shape" in parts:
        desc = f"{label} of {_shape_text(dt, parts['shape'])}"
    elif "shapes" in parts:
        desc = f"{label} of {dt} pieces {[list(s) for s in parts['shapes']]}"
    elif "sends" in parts:
        desc = f"{label} of {dt} sending {[list(s) for s in parts['sends']]}"
    else:
        desc = label
    if parts.get("root") is not None:
        desc += f" (root {parts['root']})"
    return desc


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def compare_signatures(group: Sequence[int], sigs: Sequence[Mapping[str, Any]], seq: int) -> str | None:
    """A message describing how the members' signatures disagree, or None when they agree."""
    where = f"group {list(group)} (call #{seq} on this group)"
    commons = [json.dumps(s["common"], sort_keys=True) for s in sigs]
    if len(set(commons)) > 1:
        by_desc: dict[str, list[int]] = {}
        for r, s in zip(group, sigs, strict=True):
            by_desc.setdefault(s["desc"], []).append(r)
        if len(by_desc) == 1:  # same text, different facts (e.g. the root): show the facts
            by_desc = {}
            for r, s, c in zip(group, sigs, commons, strict=True):
                by_desc.setdefault(f"{s['desc']} {c}", []).append(r)
        lines = [
            f"  rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]} issued {d}" for d, rs in by_desc.items()
        ]
        return (
            f"MPIPAR_CHECK_COLLECTIVES: the members of {where} issued different collectives:\n"
            + "\n".join(lines)
            + "\nEvery member of a group must issue the same collectives in the same order, with the same "
            "dtype and shapes; look for a collective inside a branch that only some ranks take."
        )
    if "sends" in sigs[0]:
        for a, src in enumerate(group):
            for b, dst in enumerate(group):
                sent, expected = sigs[a]["sends"][b], sigs[b]["recvs"][a]
                if list(sent) != list(expected):
                    return (
                        f"MPIPAR_CHECK_COLLECTIVES: in {sigs[a]['desc'].split(' of ')[0]} on {where}, rank {src} "
                        f"sends a piece of shape {list(sent)} to rank {dst}, which expects {list(expected)}; "
                        "the members disagree about the layout (different global shapes or placements?)"
                    )
    return None


# ------------------------------------------------------------------------------ watchdog
@dataclass
class Waiting:
    """One blocking wait: what, on which group, which call on that group."""

    op: str
    group: tuple[int, ...]
    seq: int
    p2p: bool = False
    start: float = field(default_factory=time.monotonic)
    notified: bool = False
    agreement: Callable[[], str | None] | None = None
    """Set while the call's signature message is in flight (``mpipar.runtime.agreement``): the
    watchdog calls it after its grace period, so a mismatch that makes the data call wait for
    ever is reported within seconds instead of at the timeout."""


@dataclass
class Notice:
    kind: str  # "waiting" | "exited"
    op: str
    group: tuple[int, ...]
    seq: int
    received: float

    def describe(self) -> str:
        if self.kind == "exited":
            return "has finished the script (exited) and will not join"
        return f"was last seen waiting in {self.op} on group {list(self.group)} (call #{self.seq} there)"


class _Watch:
    """The context of one ``Watchdog.watch``: makes its wait the current one, then restores
    the previous (a class, as it wraps every collective: cheaper than a generator)."""

    __slots__ = ("_dog", "_previous", "waiting")

    def __init__(self, dog: Watchdog, waiting: Waiting) -> None:
        self._dog = dog
        self.waiting = waiting
        self._previous: Waiting | None = None

    def __enter__(self) -> Waiting:
        self._previous = previous = self._dog._current
        if previous is not None:  # nested (a check inside a collective): keep the outer clock
            self.waiting.start = previous.start
        self._dog._current = self.waiting
        return self.waiting

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._dog._current = self._previous
        self._dog.completed += 1
        if exc is not None and isinstance(exc, self._dog._mpi.Exception):
            raise CollectiveDesyncError(self.waiting, exc, self._dog.rank) from exc


class Watchdog:
    """Deadlines and arrival notices for every blocking wait (see the module docstring).

    ``mpi`` is the ``mpi4py.MPI`` module (passed in so this module imports no MPI),
    ``comm`` a private duplicate of ``COMM_WORLD`` for notices (None until it exists),
    ``abort`` ends the job, ``on_expire`` runs first (the NCCL backend aborts its
    communicators there).
    """

    def __init__(self, mpi: Any, rank: int, size: int, timeout: float, abort: Callable[[], None]) -> None:
        self._mpi = mpi
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.grace = min(1.0, timeout / 4)
        self._poll = min(0.1, timeout / 20)
        self._abort = abort
        self.comm: Any = None
        self.on_expire: list[Callable[[], None]] = []
        self._current: Waiting | None = None
        self.completed = 0
        """Waits finished so far: the launcher's heartbeat reads it as progress."""
        self._latest: dict[int, Notice] = {}
        self._sends: list[tuple[Any, bytes, int]] = []  # (request, payload kept alive, destination)
        self._said_exited = False
        self._lock = threading.Lock()
        self._can_talk = mpi.Query_thread() == mpi.THREAD_MULTIPLE
        self._thread = threading.Thread(target=self._run, name="mpipar-watchdog", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- main-thread side
    def progress(self) -> tuple[str | None, int]:
        """(the wait in progress, as text, or None; waits completed): the heartbeat's probe."""
        waiting = self._current
        where = None if waiting is None else f"{waiting.op} on group {list(waiting.group)}"
        return where, self.completed

    def watch(self, op: str, group: Sequence[int], seq: int, p2p: bool = False) -> _Watch:
        """Run a blocking wait under the deadline (``with watchdog.watch(...) as waiting:``)."""
        return _Watch(self, Waiting(op, tuple(group), seq, p2p))

    def announce_exit(self) -> None:
        """Tell every rank this one has finished the script, and wait until all have.

        Called at interpreter exit. Waiting for every other rank's "exited" notice means no
        notice is left unreceived at ``MPI_Finalize`` (network transports warn about those):
        "exited" is each rank's last notice, and notices from one rank arrive in order. A rank
        that lingers longer than ``MPIPAR_TIMEOUT`` gets a warning, not an abort: the script
        itself has succeeded.
        """
        if self.comm is None or not self._can_talk or self.size == 1:
            return
        self._notify("exited", Waiting("exit", (self.rank,), 0))
        deadline = time.monotonic() + self.timeout

        def peers_not_finished() -> list[int]:
            return [r for r in range(self.size) if r != self.rank and not self._has_exited(r)]

        def notices_in_flight() -> list[int]:
            with self._lock:
                self._reap()
                return sorted({dst for _, _, dst in self._sends})

        # First every peer's "exited"; then our own notices complete before MPI_Finalize: a send
        # still pending there may never be delivered, and its rank would wait for our "exited"
        # until the timeout. Every peer is in one of these loops, progressing MPI, so they
        # complete; and every peer's last message to us, its "exited", has arrived.
        self._drain()
        for outstanding, problem in (
            (peers_not_finished, "rank(s) {} did not finish"),
            (notices_in_flight, "its exit notices to rank(s) {} were not delivered"),
        ):
            while waiting_for := outstanding():
                if time.monotonic() > deadline:
                    print(
                        f"mpipar: rank {self.rank} finished, but {problem.format(waiting_for)} within "
                        f"MPIPAR_TIMEOUT={self.timeout:g} s; exiting anyway",
                        file=sys.stderr,
                    )
                    flush_std_streams()
                    break
                self._drain()
                time.sleep(0.005)

    def _has_exited(self, rank: int) -> bool:
        n = self._latest.get(rank)
        return n is not None and n.kind == "exited"

    # -------------------------------------------------------------- notices
    def _notify(self, kind: str, waiting: Waiting) -> None:
        if self.comm is None or not self._can_talk or self.size == 1:
            return
        payload = json.dumps(
            {"kind": kind, "op": waiting.op, "group": list(waiting.group), "seq": waiting.seq}
        ).encode()
        with self._lock:
            if self._said_exited:
                # "exited" is the last word: the watchdog thread may still be about to report a
                # wait that ended just before the exit, and a peer reading that after "exited"
                # would think this rank still busy and wait for it until the timeout
                return
            self._said_exited = kind == "exited"
            self._reap()
            for dst in range(self.size):
                # "exited" goes to every peer, finished ones too: a finished rank is still in
                # announce_exit, waiting for every peer's "exited" before it may leave
                if dst != self.rank and (kind == "exited" or not self._has_exited(dst)):
                    req = self.comm.Isend([payload, self._mpi.BYTE], dest=dst, tag=NOTICE_TAG)
                    self._sends.append((req, payload, dst))

    def _reap(self) -> None:
        self._sends = [(req, buf, dst) for req, buf, dst in self._sends if not req.Test()]

    def _drain(self) -> None:
        if self.comm is None or not self._can_talk:
            return
        mpi = self._mpi
        status = mpi.Status()
        with self._lock:
            while self.comm.Iprobe(source=mpi.ANY_SOURCE, tag=NOTICE_TAG, status=status):
                src, count = status.Get_source(), status.Get_count(mpi.BYTE)
                buf = bytearray(count)
                self.comm.Recv([buf, mpi.BYTE], source=src, tag=NOTICE_TAG)
                msg = json.loads(buf.decode())
                if self._has_exited(src):
                    continue  # nothing a rank says after "exited" (an older sender's race) undoes it
                self._latest[src] = Notice(msg["kind"], msg["op"], tuple(msg["group"]), msg["seq"], time.monotonic())

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            while True:
                time.sleep(self._poll)
                waiting = self._current
                if waiting is None:
                    continue
                elapsed = time.monotonic() - waiting.start
                if elapsed < self.grace:
                    continue
                if not waiting.notified:
                    waiting.notified = True
                    self._notify("waiting", waiting)
                check = waiting.agreement
                problem = check() if check is not None else None
                if problem:
                    print(f"mpipar: {problem}", file=sys.stderr)
                    flush_std_streams()
                    self._abort()
                    return
                self._drain()
                gone = self._exited_members(waiting)
                if gone or elapsed >= self.timeout:
                    self._expire(waiting, elapsed, gone)
        except Exception as exc:  # a dead watchdog would turn the next fault into a hang
            print(f"mpipar: the fault watchdog failed ({exc!r}); aborting to avoid a silent hang", file=sys.stderr)
            flush_std_streams()
            self._abort()

    def _exited_members(self, waiting: Waiting) -> list[int]:
        now = time.monotonic()
        return [
            r
            for r in waiting.group
            if r != self.rank
            and (n := self._latest.get(r)) is not None
            and n.kind == "exited"
            and now - max(n.received, waiting.start) >= EXIT_GRACE_S
        ]

    def _arrived(self, waiting: Waiting) -> list[int]:
        out = [self.rank]
        for r in waiting.group:
            n = self._latest.get(r)
            if (
                r != self.rank
                and n is not None
                and n.kind == "waiting"
                and n.group == waiting.group
                and n.seq == waiting.seq
            ):
                out.append(r)
        return sorted(out)

    def describe(self, waiting: Waiting, elapsed: float, gone: Sequence[int]) -> str:
        """The timeout message: op, group, who never arrived and what each was doing."""
        where = f"{waiting.op} on group {list(waiting.group)}" + (
            "" if waiting.p2p else f" (call #{waiting.seq} on this group)"
        )
        if gone:
            head = f"mpipar: rank {self.rank} waits in {where}, but a member has left the script:"
        else:
            head = f"mpipar: {where} did not complete within MPIPAR_TIMEOUT={self.timeout:g} s on rank {self.rank}:"
        lines = [head]
        others = [r for r in waiting.group if r != self.rank]
        if not self._can_talk or self.comm is None:
            lines.append(
                "  the ranks that never arrived cannot be named (MPI is not initialized with "
                "MPI_THREAD_MULTIPLE, or the failure came before the side channel was up)"
            )
        elif waiting.p2p:
            for r in others:
                n = self._latest.get(r)
                lines.append(
                    f"  rank {r} {n.describe() if n else 'sent no word: busy outside mpipar communication, hung or dead'}"
                )
        else:
            arrived = self._arrived(waiting)
            missing = [r for r in waiting.group if r not in arrived]
            lines.append(f"  never arrived: rank{'s' if len(missing) != 1 else ''} {missing}")
            for r in missing:
                n = self._latest.get(r)
                lines.append(
                    f"  rank {r} {n.describe() if n else 'sent no word: busy outside mpipar collectives, hung or dead'}"
                )
            lines.append(f"  arrived and waiting: rank{'s' if len(arrived) != 1 else ''} {arrived}")
        if not gone:
            lines.append(
                "If a rank legitimately computes longer than that between collectives, raise MPIPAR_TIMEOUT "
                "(seconds); otherwise some rank skipped or reordered a collective (MPIPAR_CHECK_COLLECTIVES=1 "
                "checks every call)."
            )
        return "\n".join(lines)

    def _expire(self, waiting: Waiting, elapsed: float, gone: Sequence[int]) -> None:
        # The first arrived rank reports; the others give it a head start so the message shows once.
        if not waiting.p2p and self._arrived(waiting)[0] != self.rank:
            until = time.monotonic() + LEADER_HEAD_START_S
            while time.monotonic() < until:
                time.sleep(self._poll)
                if self._current is not waiting:
                    return
            self._drain()
        message = self.describe(waiting, elapsed, gone)
        for hook in self.on_expire:
            with contextlib.suppress(Exception):
                hook()
        print(message, file=sys.stderr)
        flush_std_streams()
        self._abort()


def report_mismatch_once(group: Sequence[int], rank: int, message: str) -> None:
    """Raise ``CollectiveMismatchError`` on the first member now, on the others a bit later.

    Every member detects the same mismatch; the first one's traceback ends the job through
    the excepthook, so the others wait before raising to keep the report single.
    """
    if rank != group[0]:
        time.sleep(LEADER_HEAD_START_S)
    raise CollectiveMismatchError(message)
