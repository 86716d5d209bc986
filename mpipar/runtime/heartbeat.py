"""The rank side of the launcher's heartbeat: a small file per rank, rewritten every second.

Under ``mpipar launch`` (which sets ``MPIPAR_LAUNCH_DIR`` to the attempt's folder) every rank
runs a daemon thread that rewrites ``<attempt>/heartbeat/rank-<r>.json`` each
``MPIPAR_HEARTBEAT_S`` seconds (default 1) with what the launcher needs to tell a hung rank
from a busy or waiting one:

    {"rank": 2, "host": "node1", "node": "node1", "pid": 4711, "main_thread": 1401..., "beat": 37,
     "step": 12, "progress": 530, "waiting": null, "state": "running", "error": null,
     "resumed_step": 10}

* ``step``: the last step the script reported (``mark_step``; ``examples/gpt.py`` calls it
  after every step), or null;
* ``progress``: grows with every reported step and every completed mpipar collective, so a
  rank that communicates is seen to move even in a script that reports no steps;
* ``waiting``: the collective the rank is blocked in (from the fault watchdog), or null. A
  rank that waits for its peers is not hung; the peer it waits for may be;
* ``beat`` grows with each write: a file that stops changing means the thread itself cannot
  run (the main thread holds the interpreter lock in C code, or the process is stopped);
* ``state``: ``running``, ``raised`` (with ``error``: the uncaught exception's type and first
  line) or ``exited`` (the interpreter is exiting without an uncaught exception: the script's
  end or ``sys.exit``);
* ``host`` is the launcher's name for the rank's host (``MPIPAR_HOST_MAP``), ``node`` the
  machine's own name (the launcher signals only ranks on its own machine), ``main_thread``
  picks the main thread's part out of a ``faulthandler`` dump of every thread.

The launcher decides (``mpipar.launch``): a rank whose progress stood still outside
any wait for ``--hang-timeout`` seconds is hung. It then asks for the rank's Python stack: by
``SIGUSR2`` when the rank runs on the launcher's machine (``faulthandler`` answers it from C,
even while the main thread holds the interpreter lock), else through a request file
``rank-<r>.dump`` the thread answers. Either way the stack lands in ``rank-<r>.stack``.

Costs: one write of ~200 bytes per rank per second, and one integer increment per
collective (``Watchdog.completed``); nothing at all outside the launcher.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from mpipar.backend import current_backend
from mpipar.env import env_number, env_text
from mpipar.runtime.hosts import host_of

DIR_ENV = "MPIPAR_LAUNCH_DIR"
INTERVAL_ENV = "MPIPAR_HEARTBEAT_S"
LIFELINE_ENV = "MPIPAR_LIFELINE"
DEFAULT_INTERVAL_S = 1.0
DUMP_SIGNAL = signal.SIGUSR2
"""The signal the launcher sends a local hung rank for its stack (``faulthandler`` answers it)."""


def folder(attempt_dir: str) -> str:
    return os.path.join(attempt_dir, "heartbeat")


def beat_path(attempt_dir: str, rank: int) -> str:
    return os.path.join(folder(attempt_dir), f"rank-{rank}.json")


def stack_path(attempt_dir: str, rank: int) -> str:
    return os.path.join(folder(attempt_dir), f"rank-{rank}.stack")


def request_path(attempt_dir: str, rank: int) -> str:
    return os.path.join(folder(attempt_dir), f"rank-{rank}.dump")


def interval_from_env(env: Any = None) -> float:
    value = env_number(INTERVAL_ENV, DEFAULT_INTERVAL_S, minimum=0.0, strict=True, unit="seconds", env=env)
    return min(max(value, 0.05), 60.0)


class Heartbeat:
    """One rank's heartbeat thread (module docstring); ``start_from_env`` creates it."""

    def __init__(
        self,
        attempt_dir: str,
        rank: int,
        host: str,
        interval: float,
        probe: Callable[[], tuple[str | None, int]] | None = None,
    ) -> None:
        self.attempt_dir = attempt_dir
        self.rank = rank
        self.interval = interval
        self.probe = probe
        self.step: int | None = None
        self.resumed_step: int | None = None
        self.steps_reported = 0
        self.state = "running"
        self.error: str | None = None
        self.beat = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._record = {
            "rank": rank,
            "host": host,
            "node": socket.gethostname(),
            "pid": os.getpid(),
            "main_thread": threading.main_thread().ident,
        }
        self._lifeline = connect_lifeline(rank)
        os.makedirs(folder(attempt_dir), exist_ok=True)
        self._stack_file: IO[str] = open(stack_path(attempt_dir, rank), "w")  # noqa: SIM115 (open for the process)
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # not the main thread, or no such signal
            faulthandler.register(DUMP_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        self._wrap_excepthook()
        self.write()
        self._thread = threading.Thread(target=self._run, name="mpipar-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.finish)

    # -------------------------------------------------------------- main-thread side
    def mark_step(self, step: int) -> None:
        self.step = int(step)
        self.steps_reported += 1

    def finish(self) -> None:
        """The script ended normally: say so, so the launcher does not wait on this rank."""
        if self.state == "running":
            self.state = "exited"
        self._stop.set()
        self.write()

    def _wrap_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            text = f"{exc_type.__name__}: {exc}".strip().splitlines()
            self.state, self.error = "raised", (text[0] if text else exc_type.__name__)[:500]
            with contextlib.suppress(Exception):
                self.write()
            previous(exc_type, exc, tb)

        sys.excepthook = hook

    # -------------------------------------------------------------- the thread
    def snapshot(self) -> dict[str, Any]:
        waiting, completed = self.probe() if self.probe is not None else (None, 0)
        return {
            **self._record,
            "beat": self.beat,
            "step": self.step,
            "progress": self.steps_reported + completed,
            "waiting": waiting,
            "state": self.state,
            "error": self.error,
            "resumed_step": self.resumed_step,
        }

    def write(self) -> None:
        path = beat_path(self.attempt_dir, self.rank)
        tmp = f"{path}.tmp"
        with self._lock:  # the thread, the excepthook and the exit handler all write
            self.beat += 1
            try:
                with open(tmp, "w") as f:
                    json.dump(self.snapshot(), f)
                os.replace(tmp, path)
            except OSError:
                pass  # a full or vanished log folder must not end the training

    def _run(self) -> None:
        request = request_path(self.attempt_dir, self.rank)
        while not self._stop.wait(self.interval):
            self.write()
            if os.path.exists(request):
                with contextlib.suppress(OSError):
                    os.unlink(request)
                    faulthandler.dump_traceback(file=self._stack_file, all_threads=True)
                    self._stack_file.flush()


def connect_lifeline(rank: int) -> socket.socket | None:
    """Connect to the launcher's lifeline (``MPIPAR_LIFELINE``, an abstract Unix socket name) and say
    which rank this is; the kernel closes the connection when this process ends, however it ends,
    which tells the launcher the order in which ranks died (``mpipar.launch.attempt.DeathWatch``).
    None where there is no launcher or it is on another machine."""
    address = env_text(LIFELINE_ENV) or ""
    if not address.startswith("@") or not sys.platform.startswith("linux"):
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + address[1:])
        conn.sendall(f"{rank}\n".encode())
    except OSError:
        conn.close()
        return None
    return conn  # held open, never read: non-inheritable, so a child process does not keep it alive


_active: Heartbeat | None = None


def active() -> Heartbeat | None:
    return _active


def start_from_env(rank: int, size: int, probe: Callable[[], tuple[str | None, int]] | None = None) -> Heartbeat | None:
    """Start this process's heartbeat when a launcher asked for one (``MPIPAR_LAUNCH_DIR``)."""
    global _active
    attempt_dir = env_text(DIR_ENV) or ""
    if _active is not None or not attempt_dir:
        return _active
    try:
        _active = Heartbeat(attempt_dir, rank, host_of(rank, size), interval_from_env(), probe)
    except OSError as exc:
        print(f"mpipar: no heartbeat for rank {rank} ({exc}); the launcher cannot watch it for hangs", file=sys.stderr)
    return _active


def mark_step(step: int) -> None:
    """Report that ``step`` is done: the launcher's heartbeat shows it, and a rank whose steps stop
    while it waits for no peer is named as hung. Costs nothing outside ``mpipar launch``."""
    beat = _ensure()
    if beat is not None:
        beat.mark_step(step)


def note_resume(step: int) -> None:
    """Record the step a run resumed from (``load_training_state`` calls it) for the launcher's summary."""
    beat = _ensure()
    if beat is not None:
        beat.resumed_step = int(step)


def _ensure() -> Heartbeat | None:
    """The heartbeat, started on first use where no backend started it (the simulator's one process)."""
    if _active is None and env_text(DIR_ENV):
        backend = current_backend()
        return start_from_env(backend.rank, backend.world_size)
    return _active
