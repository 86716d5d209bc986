"""A stderr sentinel: explains MPICH's own fatal aborts, which no Python code of the rank outlives.

When the ranks of a group issue different collectives (one skipped or reordered a call) and
check mode is off, MPICH usually notices first, as a size mismatch ("Message truncated"), and
marks that error fatal: it prints its error stack and ends the process from C, whatever error
handler the communicator has, so neither an exception nor the excepthook ever runs. Only a
process outside the rank can add a word after that. So each rank hands its stderr (file
descriptor 2) to a small relay process that copies every byte through unchanged and, when the
stream ends, checks whether the last thing the rank wrote was such an abort; if so it adds one
line: what this usually means and that ``MPIPAR_CHECK_COLLECTIVES=1`` names the rank at fault.

The relay keeps the launcher's stderr pipe open until it has written, so the launcher waits
for that line (the launcher kills ranks, not their children). It costs one small process per
rank started once, and nothing per collective. ``MPIPAR_STDERR_SENTINEL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping

from mpipar.env import env_flag

HINT = (
    "mpipar: MPI aborted rank {rank} inside a collective. With MPICH, 'Message truncated' (or another size or "
    "type mismatch) in a collective almost always means the ranks of a group issued different "
    "collectives, or the same one with different shapes or dtypes: a rank skipped, added or "
    "reordered a call. Rerun with MPIPAR_CHECK_COLLECTIVES=1: every collective then compares what "
    "each member issued and names the rank that differs.\n"
)

# The relay: copy stdin to stdout unchanged, keep the tail, add the hint after a fatal abort.
# Run with -I -S (no site, no user paths): it starts in milliseconds and imports nothing of ours.
_RELAY = r"""
import os, sys
fd_in, fd_out = 0, 1
tail = b""
while True:
    try:
        chunk = os.read(fd_in, 65536)
    except InterruptedError:
        continue
    if not chunk:
        break
    view = memoryview(chunk)
    while view:
        try:
            view = view[os.write(fd_out, view):]
        except InterruptedError:
            continue
        except OSError:
            view = view[:0]
    tail = (tail + chunk)[-16384:]
if b"Fatal error in" in tail and any(k in tail for k in MARKERS):
    try:
        os.write(fd_out, HINT)
    except OSError:
        pass
"""

MARKERS = (b"truncated", b"MPI_ERR_TRUNCATE", b"Invalid count", b"mismatch", b"Message from rank")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return env_flag("MPIPAR_STDERR_SENTINEL", True, env)


class StderrSentinel:
    """The relay process of one rank (``start`` once, after MPI is up)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, rank: int) -> bool:
        """Route file descriptor 2 through the relay; False (and nothing changed) where it cannot."""
        if self.process is not None:
            return True
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        try:
            original = os.dup(2)
        except OSError:
            return False
        code = f"MARKERS = {MARKERS!r}\nHINT = {HINT.format(rank=rank).encode()!r}\n{_RELAY}"
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", code],
                stdin=subprocess.PIPE,
                stdout=original,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                # Its own session: a Ctrl-C or a launcher's signal to the rank's group must not
                # end the relay before the rank's last words are through.
                start_new_session=True,
            )
        except OSError:
            os.close(original)
            return False
        os.close(original)
        assert self.process.stdin is not None
        os.dup2(self.process.stdin.fileno(), 2)
        # fd 2 is now the pipe's write end; the relay sees end of file when the rank exits.
        self.process.stdin.close()
        return True
