"""One attempt of a launched job: start it, show rank 0 live, watch the heartbeats, end it, say how.

The ranks' output goes to ``<attempt>/workerlog.<rank>`` by hydra itself
(``-outfile-pattern``/``-errfile-pattern`` with ``%r``, written by ``mpiexec`` on the launching
machine, so the logs of every host land here, stdout and stderr of a rank in one file in the
order they arrived). The launcher follows ``workerlog.0`` and copies it to its own stdout as it
grows; ``mpiexec``'s own words (hydra's ``BAD TERMINATION`` report) go to ``<attempt>/mpiexec.log``
and to the launcher's stderr. Under ``--simulate`` the one process's output is ``workerlog.0``.

The heartbeat watch (``HeartbeatWatch``) reads ``<attempt>/heartbeat/rank-<r>.json`` once per
beat interval (see ``mpipar.runtime.heartbeat`` for the rank side) and names a hung rank:
running, waiting for no peer, its steps and collectives standing still for ``hang_timeout``
seconds (or its heartbeat file standing still that long: the rank's threads cannot run). The
launcher then asks for its Python stack, gives it ``STACK_WAIT_S`` to arrive, and ends the
attempt: SIGTERM to mpiexec's process group, SIGKILL ``KILL_GRACE_S`` later. So a hang ends
the attempt at most ``hang_timeout + interval + STACK_WAIT_S + KILL_GRACE_S`` seconds after the
rank's last progress (``hang_bound``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from mpipar.runtime import heartbeat as hb

STACK_WAIT_S = 3.0
KILL_GRACE_S = 5.0
POLL_S = 0.1
MAX_STACK_BYTES = 64 * 1024
MAX_BEAT_BYTES = 64 * 1024
_BAD_TERMINATION = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)")


def hang_bound(hang_timeout: float, interval: float) -> float:
    """Seconds from a hung rank's last progress to the end of its attempt, at most."""
    return hang_timeout + interval + STACK_WAIT_S + KILL_GRACE_S


@dataclass
class Hang:
    rank: int
    host: str
    step: int | None
    stack: str
    starved: bool
    """The rank's heartbeat thread itself stopped (the main thread holds the interpreter lock)."""

    def describe(self, hang_timeout: float) -> str:
        step = f"after step {self.step}" if self.step is not None else "before reporting any step"
        why = (
            "its heartbeat stopped (its threads cannot run: stuck in C code holding the interpreter lock, or stopped)"
            if self.starved
            else "it waits for no peer, yet its steps and collectives stood still"
        )
        return (
            f"rank {self.rank} on {self.host} hung {step}: {why} for {hang_timeout:g} s (--hang-timeout)\n"
            f"its Python stack:\n{self.stack.rstrip() or '  (none arrived: the process did not answer)'}"
        )


@dataclass
class Outcome:
    """How an attempt ended."""

    attempt: int
    returncode: int
    seconds: float
    ranks: dict[int, str] = field(default_factory=dict)
    """Per rank: ``finished the script``, ``raised ...``, ``killed by signal 9``, ``hung``, ``ended with the job``."""
    cause: str = ""
    error: str = ""
    """The failure's kind and message (for the same-failure-twice check)."""
    culprit: int | None = None
    """The rank the failure is blamed on, or None."""
    last_step: int | None = None
    resumed_step: int | None = None
    hang: Hang | None = None
    interrupted: int = 0
    """The signal that interrupted the launcher (SIGINT, SIGTERM), or 0."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.hang and not self.interrupted


class HeartbeatWatch:
    """The launcher's side of the heartbeat (module docstring)."""

    def __init__(self, attempt_dir: str, ranks: Sequence[int], hang_timeout: float, interval: float) -> None:
        self.attempt_dir = attempt_dir
        self.ranks = list(ranks)
        self.hang_timeout = hang_timeout
        self.interval = interval
        self.last: dict[int, dict[str, Any]] = {}
        self._moved: dict[int, float] = {}
        self._beat: dict[int, tuple[int, float]] = {}
        self._next = 0.0
        self.me = socket.gethostname()

    def read(self, rank: int) -> dict[str, Any] | None:
        """A rank's last heartbeat (untrusted: bounded, checked, None when unreadable)."""
        try:
            with open(hb.beat_path(self.attempt_dir, rank), "rb") as f:
                data = json.loads(f.read(MAX_BEAT_BYTES))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("rank") != rank:
            return None
        return data

    def poll(self, now: float) -> int | None:
        """Read the heartbeats (once per interval); the rank found hung, or None."""
        if now < self._next:
            return None
        self._next = now + self.interval
        hung = None
        for r in self.ranks:
            beat = self.read(r)
            if beat is None:
                continue
            prev = self.last.get(r)
            self.last[r] = beat
            moved = (beat.get("step"), beat.get("progress"), beat.get("waiting"))
            if prev is None or (prev.get("step"), prev.get("progress"), prev.get("waiting")) != moved:
                self._moved[r] = now
            if r not in self._beat or self._beat[r][0] != beat.get("beat"):
                self._beat[r] = (beat.get("beat"), now)  # type: ignore[assignment]
            if beat.get("state") != "running" or hung is not None:
                continue
            idle = beat.get("waiting") is None and bool(beat.get("progress"))
            if (idle and now - self._moved[r] >= self.hang_timeout) or now - self._beat[r][1] >= self.hang_timeout:
                hung = r
        return hung

    def starved(self, rank: int, now: float) -> bool:
        return now - self._beat.get(rank, (0, now))[1] >= self.hang_timeout

    def ask_stack(self, rank: int) -> None:
        """A signal to a rank on this machine (faulthandler answers it from C); a request file otherwise."""
        beat = self.last.get(rank, {})
        pid = beat.get("pid")
        if beat.get("node") == self.me and isinstance(pid, int) and pid > 1:
            with contextlib.suppress(OSError):
                os.kill(pid, hb.DUMP_SIGNAL)
                return
        with contextlib.suppress(OSError), open(hb.request_path(self.attempt_dir, rank), "w"):
            pass

    def stack(self, rank: int, wait: float) -> str:
        path = hb.stack_path(self.attempt_dir, rank)
        deadline = time.monotonic() + wait
        text, size = "", -1
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), open(path, "rb") as f:
                text = f.read(MAX_STACK_BYTES).decode("utf-8", "replace")
            if text and len(text) == size:  # complete: it stopped growing
                break
            size = len(text)
            time.sleep(0.2)
        return text


class DeathWatch:
    """The order in which this machine's ranks die: the first to go is the culprit; the rest are
    the job's cleanup (mpiexec kills them once one fails).

    Each rank on this machine holds a *lifeline*, a Unix socket connected to the launcher
    (``MPIPAR_LIFELINE``, ``mpipar.runtime.heartbeat``); the kernel closes it in the same sweep that
    closes the rank's stdout and its PMI socket, the first things hydra can notice. So the
    killed rank's lifeline ends before hydra can even start the cleanup, and the peers' end only
    after hydra's round trip (proxy, mpiexec, proxy) and their own teardown: milliseconds later.
    A thread of its own waits on the lifelines and stamps each wake-up, so the launcher's loop,
    busy copying logs or reading heartbeats, cannot merge them. Lifelines seen ending in one
    wake-up (a launcher starved of CPU for the whole round trip) still keep their order: epoll
    hands ready descriptors back in the order they became ready, which is the order the
    kernel closed them, so the first of them is the culprit. A wake-up whose deaths include a
    pidfd is a tie; ``first`` returns all its ranks.

    The end of a process (a pidfd) is weaker evidence: a killed rank's last threads may be
    scheduled after a peer hydra killed later has gone entirely. Pidfds serve only ranks without
    a lifeline (a script that ended before it connected).
    """

    def __init__(self, nprocs: int, lifelines: bool = True) -> None:
        self.nprocs = nprocs
        self.died: list[tuple[int, int]] = []  # (rank, wake-up number), in the order seen
        self._by_lifeline: list[bool] = []  # per entry of ``died``: seen by its lifeline's end
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[str, int, Any]] = {}  # fd -> (kind, rank, socket or None)
        self._ranks: set[int] = set()  # ranks with a lifeline or a pidfd
        self._lifelines: set[int] = set()
        self._pending: dict[int, socket.socket] = {}  # connected, rank not said yet
        self._server: socket.socket | None = None
        self._wakeups = 0
        self._closing = False
        self.address = ""
        self._ep = select.epoll() if hasattr(select, "epoll") else None
        if self._ep is None:
            return
        self._wake_r, self._wake_w = os.pipe()
        self._ep.register(self._wake_r, select.EPOLLIN)
        if lifelines and sys.platform.startswith("linux"):
            # an abstract name (Linux): no file to clean up, no 108-byte path limit; the random part
            # keeps other jobs' ranks (and anyone guessing) off it
            name = f"mpipar-lifeline-{os.getpid()}-{os.urandom(8).hex()}"
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                server.bind("\0" + name)
                server.listen(max(nprocs, 8))
            except OSError:
                server.close()
            else:
                server.setblocking(False)
                self._server, self.address = server, "@" + name
                self._ep.register(server.fileno(), select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="mpipar-death-watch", daemon=True)
        self._thread.start()

    def add(self, rank: int, pid: object) -> None:
        """Watch a rank's process by pid (for a rank that holds no lifeline)."""
        if self._ep is None or not hasattr(os, "pidfd_open") or not isinstance(pid, int) or pid <= 1:
            return
        with self._lock:
            if rank in self._ranks or self._closing:
                return
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return
            self._ranks.add(rank)
            self._fds[fd] = ("pid", rank, None)
            self._ep.register(fd, select.EPOLLIN)  # a waiting epoll sees it at once

    def _run(self) -> None:
        assert self._ep is not None
        while True:
            events = self._ep.poll()
            with self._lock:
                if self._closing:
                    return
                dead: list[tuple[int, bool]] = []  # (rank, by its lifeline), in epoll's (readiness) order
                for fd, _ in events:
                    if fd == self._wake_r:
                        continue
                    if self._server is not None and fd == self._server.fileno():
                        self._accept()
                    elif fd in self._pending:
                        self._hello(fd, dead)
                    elif fd in self._fds:
                        self._event(fd, dead)
                if dead:
                    self._wakeups += 1
                    self.died.extend((r, self._wakeups) for r, _ in dead)
                    self._by_lifeline.extend(lifeline for _, lifeline in dead)

    def _accept(self) -> None:
        assert self._server is not None and self._ep is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:  # BlockingIOError: no more waiting
                return
            conn.setblocking(False)
            self._pending[conn.fileno()] = conn
            self._ep.register(conn.fileno(), select.EPOLLIN)

    def _hello(self, fd: int, dead: list[tuple[int, bool]]) -> None:
        """A connection's first words: its rank (untrusted: a bounded decimal integer, once per rank)."""
        assert self._ep is not None
        conn = self._pending.pop(fd)
        try:
            data = conn.recv(32)
        except OSError:
            data = b""
        text = data.decode("ascii", "replace").strip()
        rank = int(text) if text.isdigit() and len(text) < 10 else -1
        if not 0 <= rank < self.nprocs or rank in self._lifelines:
            self._ep.unregister(fd)
            conn.close()
            return
        for other, (kind, r, _) in list(self._fds.items()):
            if kind == "pid" and r == rank:  # its heartbeat was read first: the lifeline supersedes the pidfd
                self._drop(other)
        self._ranks.add(rank)
        self._lifelines.add(rank)
        self._fds[fd] = ("lifeline", rank, conn)
        self._event(fd, dead)  # it may be dead already: then its EOF came with the hello

    def _event(self, fd: int, dead: list[tuple[int, bool]]) -> None:
        kind, rank, conn = self._fds[fd]
        if kind == "lifeline":
            try:
                if conn.recv(4096) != b"":
                    return  # said something more: ignored, it is alive
            except (BlockingIOError, InterruptedError):
                return  # alive
            except OSError:
                pass
        self._drop(fd)
        dead.append((rank, kind == "lifeline"))

    def _drop(self, fd: int) -> None:
        assert self._ep is not None
        _, _, conn = self._fds.pop(fd)
        with contextlib.suppress(OSError):
            self._ep.unregister(fd)
        with contextlib.suppress(OSError):
            conn.close() if conn is not None else os.close(fd)

    def first(self) -> list[int]:
        """The rank that died first, or the ranks tied for first (seen in one wake-up, one of
        them by its pidfd); empty when none was seen to die."""
        with self._lock:
            if not self.died:
                return []
            w0 = self.died[0][1]
            batch = [i for i, (_, w) in enumerate(self.died) if w == w0]
            if all(self._by_lifeline[i] for i in batch):  # the kernel's order of the ends
                return [self.died[0][0]]
            return [self.died[i][0] for i in batch]

    def close(self) -> None:
        if self._ep is None:
            return
        with self._lock:
            self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with self._lock:
            for fd in list(self._fds):
                self._drop(fd)
            for conn in self._pending.values():
                conn.close()
            self._pending.clear()
            if self._server is not None:
                self._server.close()
            self._ep.close()
            self._ep = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Follower:
    """Copies a growing file to a stream (rank 0's log to the launcher's stdout)."""

    def __init__(self, path: str, out: IO[bytes]) -> None:
        self.path, self.out = path, out
        self._f: IO[bytes] | None = None

    def pump(self) -> None:
        if self._f is None:
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115 (kept open while it grows)
            except OSError:
                return
        while chunk := self._f.read(65536):
            with contextlib.suppress(OSError, ValueError):
                self.out.write(chunk)
                self.out.flush()

    def close(self) -> None:
        self.pump()
        if self._f is not None:
            self._f.close()


def _copy(stream: IO[bytes], sink: IO[bytes], also: IO[bytes] | None) -> None:
    """mpiexec's own output: to its log file and to the launcher's stderr (a thread per stream)."""
    for line in iter(stream.readline, b""):
        sink.write(line)
        sink.flush()
        if also is not None:
            with contextlib.suppress(OSError, ValueError):
                also.write(line)
                also.flush()


class Interrupts:
    """SIGINT/SIGTERM to the launcher: remembered and forwarded to the running attempt."""

    def __init__(self) -> None:
        self.signum = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        first = not self.signum
        self.signum = self.signum or signum
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                # mpiexec forwards SIGINT/SIGTERM to every rank; a second Ctrl-C kills outright.
                os.killpg(proc.pid, signum if first else signal.SIGKILL)


def run_attempt(
    attempt: int,
    command: Sequence[str],
    env: dict[str, str],
    attempt_dir: str,
    nprocs: int,
    simulate: bool,
    hang_timeout: float,
    interval: float,
    interrupts: Interrupts,
    out: IO[bytes],
    err: IO[bytes],
) -> Outcome:
    """Run one attempt to its end (module docstring) and describe how it ended."""
    os.makedirs(attempt_dir, exist_ok=True)
    for r in range(1 if simulate else nprocs):  # a rank that prints nothing still has its (empty) log
        with open(os.path.join(attempt_dir, f"workerlog.{r}"), "ab"):
            pass
    start = time.monotonic()
    rank0 = os.path.join(attempt_dir, "workerlog.0")
    # The simulator's one process writes workerlog.0 itself; mpiexec's own words get a file.
    own_log = open(os.path.join(attempt_dir, "workerlog.0" if simulate else "mpiexec.log"), "wb")  # noqa: SIM115
    sim_log = own_log if simulate else None
    # the lifelines must listen before a rank can start; the simulator's one process is the child itself
    deaths = DeathWatch(nprocs, lifelines=not simulate)
    if deaths.address:
        env = {**env, hb.LIFELINE_ENV: deaths.address}
    proc = subprocess.Popen(
        list(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=sim_log if sim_log is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT if sim_log is not None else subprocess.PIPE,
        start_new_session=True,  # the terminal's Ctrl-C reaches the launcher, which forwards it
    )
    interrupts.proc = proc
    if interrupts.signum:  # interrupted while starting
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, interrupts.signum)
    copiers = [
        threading.Thread(target=_copy, args=(s, own_log, also), daemon=True)
        for s, also in ((proc.stdout, err), (proc.stderr, err))
        if s is not None
    ]
    for t in copiers:
        t.start()
    follower = Follower(rank0, out)
    watch = HeartbeatWatch(attempt_dir, range(1 if simulate else nprocs), hang_timeout, interval)
    hang: Hang | None = None
    killed_at: float | None = None
    while proc.poll() is None:
        now = time.monotonic()
        follower.pump()
        if hang is None and killed_at is None:
            hung = watch.poll(now)
            for r, beat in watch.last.items():
                if beat.get("node") == watch.me:
                    deaths.add(r, beat.get("pid"))
            if hung is not None:
                starved = watch.starved(hung, now)
                watch.ask_stack(hung)
                beat = watch.last.get(hung, {})
                stack = main_stack(watch.stack(hung, STACK_WAIT_S), beat.get("main_thread"))
                hang = Hang(hung, str(beat.get("host", "?")), beat.get("step"), stack, starved)
                _terminate(proc, signal.SIGTERM)
                killed_at = time.monotonic()
        if killed_at is not None and time.monotonic() - killed_at > KILL_GRACE_S:
            _terminate(proc, signal.SIGKILL)
        time.sleep(POLL_S)  # the death watch's own thread keeps the order of deaths meanwhile
    deaths.close()
    for t in copiers:
        t.join(timeout=5)
    follower.close()
    own_log.close()
    interrupts.proc = None
    seconds = time.monotonic() - start
    watch.poll(float("inf"))  # the final states (exited / raised)
    first = deaths.first() if killed_at is None and not interrupts.signum else []
    return _describe(
        attempt, proc.returncode, seconds, watch, attempt_dir, nprocs, simulate, hang, interrupts.signum, first
    )


def _terminate(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, sig)


def _describe(
    attempt: int,
    returncode: int,
    seconds: float,
    watch: HeartbeatWatch,
    attempt_dir: str,
    nprocs: int,
    simulate: bool,
    hang: Hang | None,
    interrupted: int,
    died_first: Sequence[int],
) -> Outcome:
    beats = watch.last
    steps: list[int] = [b["step"] for b in beats.values() if isinstance(b.get("step"), int)]
    resumed: list[int] = [b["resumed_step"] for b in beats.values() if isinstance(b.get("resumed_step"), int)]
    outcome = Outcome(
        attempt,
        returncode,
        seconds,
        last_step=max(steps) if steps else None,
        resumed_step=min(resumed) if resumed else None,
        hang=hang,
        interrupted=interrupted,
    )
    if returncode == 0 and hang is None and not interrupted:
        return outcome
    reports = _bad_terminations(os.path.join(attempt_dir, "mpiexec.log"))
    codes = [code for _, code in reports]
    if len(died_first) > 1 and reports:
        # seen dead in one wake-up (the launcher starved of CPU): hydra's report breaks the tie when it
        # names one of them (it names whichever process it collected first, so it decides nothing alone)
        named = [r for r in died_first if beats.get(r, {}).get("pid") == reports[0][0]]
        died_first = named or died_first
    for r in range(1 if simulate else nprocs):
        b = beats.get(r, {})
        if hang is not None and r == hang.rank:
            text = "hung"
        elif b.get("state") == "raised":
            text = f"raised {b.get('error')}"
        elif b.get("state") == "exited":
            text = "finished the script"
        elif simulate:  # the launcher's own child: its status is known
            text = f"exit {returncode}" if returncode >= 0 else f"killed by signal {-returncode}"
        elif r in died_first:
            # mpiexec's report names one dead process's status; the one it saw first is the culprit's
            text = f"killed by signal {codes[0]}" if codes and 0 < codes[0] < 64 else "died"
        elif isinstance(b.get("waiting"), str):
            text = f"ended with the job (waiting in {b['waiting'][:200]})"
        else:
            text = "ended with the job"
        outcome.ranks[r] = text
    if simulate:  # one process hosts every rank: they share its fate
        outcome.ranks = dict.fromkeys(range(nprocs), outcome.ranks[0])
    if interrupted:
        outcome.cause = f"interrupted by {signal.Signals(interrupted).name}"
        outcome.error = outcome.cause
    elif hang is not None:
        outcome.cause = f"rank {hang.rank} on {hang.host} hung"
        outcome.culprit = hang.rank
        outcome.error = f"hung: {_top_frame(hang.stack)}"
        outcome.last_step = hang.step
    else:
        first = None
        for kind in ("raised", "killed", "died"):  # an error names its rank; a death may be the abort's echo
            first = next((r for r, t in outcome.ranks.items() if t.startswith(kind)), None)
            if first is not None:
                break
        if first is None:
            first = next((r for r, t in outcome.ranks.items() if not t.startswith(("finished", "ended with"))), None)
        what = outcome.ranks.get(first, f"exit {returncode}") if first is not None else f"exit {returncode}"
        outcome.cause = f"rank {first} {what}" if first is not None else f"mpiexec ended with status {returncode}"
        outcome.error = what
        outcome.culprit = first
        b = beats.get(first, {}) if first is not None else {}
        if isinstance(b.get("step"), int):
            outcome.last_step = b["step"]
    return outcome


def _bad_terminations(path: str) -> list[tuple[int, int]]:
    """(pid, exit code) of hydra's ``BAD TERMINATION ... PID p RUNNING AT h ... EXIT CODE: c`` reports."""
    try:
        with open(path, "rb") as f:
            text = f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return []
    text = re.sub(r"\n=\s*", " = ", text)
    return [(int(m.group(1)), int(m.group(3))) for m in _BAD_TERMINATION.finditer(text)]


def main_stack(dump: str, ident: object) -> str:
    """The main thread's part of a ``faulthandler`` dump of every thread (all of it when not found)."""
    if not isinstance(ident, int):
        return dump
    sections = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    mine = [s for s in sections if re.match(rf"(?:Current thread|Thread) 0x0*{ident:x} ", s)]
    return mine[-1] if mine else dump


def _top_frame(stack: str) -> str:
    """The innermost frame of the hung thread's stack (what repeats when a hang repeats)."""
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith("File "):
            return line
    return "no stack"
