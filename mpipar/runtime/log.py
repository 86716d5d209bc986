"""Output under MPI: ``print_once`` for training lines, and a ``[rank N] `` prefix for the rest.

    import mpipar as dist
    dist.print_once(f"step {step} loss {loss:.6f}")   # rank 0 prints; in the simulator: prints

When the MPI backend starts it wraps ``sys.stdout`` and ``sys.stderr`` in ``LinePrefixer``:
every line a non-zero rank writes gets ``[rank N] `` in front, rank 0 prints plainly, and
each line reaches the launcher in one write, so lines of different ranks never interleave
mid-line.
"""

from __future__ import annotations

import io
import sys
import threading
from typing import Any, TextIO

from mpipar.backend import current_backend


def print_once(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (under MPI); in the simulator and the reference, just ``print``."""
    if current_backend().rank == 0:
        print(*args, **kwargs)


class LinePrefixer(io.TextIOBase):
    """A text stream that writes whole lines, each starting with ``prefix``, to ``stream``."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        super().__init__()
        self.stream = stream
        self.prefix = prefix
        self._partial = ""
        self._lock = threading.Lock()  # the watchdog thread prints too

    def write(self, text: str) -> int:
        with self._lock:
            data = self._partial + text
            lines = data.split("\n")
            self._partial = lines.pop()
            if lines:
                self.stream.write("".join(f"{self.prefix}{line}\n" for line in lines))
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._partial:
                self.stream.write(self.prefix + self._partial)
                self._partial = ""
            self.stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.stream, "errors", None)


def install_rank_prefix(rank: int) -> None:
    """Wrap stdout and stderr once: ``[rank N] `` on rank N > 0, whole lines on every rank."""
    prefix = f"[rank {rank}] " if rank else ""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, LinePrefixer):
            continue
        setattr(sys, name, LinePrefixer(stream, prefix))


def flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe at exit must not mask the real error
            pass
