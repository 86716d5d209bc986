"""What mpipar may delete, and who may save: our marker, our step folders, one save per path.

A checkpoint library that cleans up after interrupted saves and prunes old checkpoints must
never remove what it did not make. Every removal goes through this module:

* ``is_partial_ours`` - an interrupted save's temporary directory: named
  ``<base>.partial-<16 hex digits>``, a real directory (not a link), holding our ``MARKER``
  (the first file a save writes) and no ``metadata.json`` (written last). A folder named
  ``model.partial-results`` someone else made carries no marker and is left alone.
* ``is_checkpoint_ours`` - a complete checkpoint: a real directory with our marker or,
  for checkpoints written before the marker existed, a well-formed mpipar ``metadata.json``.
* ``parse_step`` - the one parser of a series' folder names: ``step-<k>`` with ``k`` written
  without leading zeros (``step-0012`` is not step 12: ``step_path(d, 12)`` is ``step-12``,
  so listing and lookup can never disagree about which folder a step is).
* ``SaveLock`` - an exclusive ``fcntl.flock`` on a lock file beside the target
  (``.<name>.mpipar-lock``): a second save to the same path is refused by name; the kernel
  releases the lock when its holder exits, however it exits, so a killed save never blocks the
  next one. The holder removes the file on release (a killed one leaves it, unlocked).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from types import TracebackType
from typing import IO

from mpipar.checkpoint.format import (
    FORMAT,
    LOCK_SUFFIX,
    MARKER,
    MARKER_TEXT,
    MAX_METADATA_BYTES,
    METADATA,
    METADATA_INT_DIGITS,
    PARTIAL_TAG,
    REPLACED_TAG,
    CheckpointError,
)
from mpipar.untrusted import FileFormatError, parse_json, read_bounded

try:  # POSIX; elsewhere a save takes no lock (documented in docs/trust.md)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

_STEP = re.compile(r"step-(0|[1-9][0-9]{0,17})")
"""Canonical step folder names; 18 digits keep ``int`` well inside int64."""
_TOKEN = re.compile(r"[0-9a-f]{16}")


def step_name(step: int) -> str:
    """The folder name of the checkpoint after ``step`` completed steps."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be a non-negative int, got {step!r}")
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    """The step of a series folder name, or None when ``name`` is not exactly ``step_name(k)``."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def has_marker(directory: str) -> bool:
    """Whether ``directory`` holds our marker file (a regular file with our text)."""
    path = os.path.join(directory, MARKER)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(len(MARKER_TEXT) + 1) == MARKER_TEXT
    except OSError:
        return False


def write_marker(directory: str) -> None:
    """Write the marker into a save's fresh temporary directory (before any data file)."""
    with open(os.path.join(directory, MARKER), "xb") as f:
        f.write(MARKER_TEXT)


def has_our_metadata(directory: str) -> bool:
    """Whether ``directory`` holds a well-formed mpipar ``metadata.json`` (format and version)."""
    try:
        meta = parse_json(
            read_bounded(os.path.join(directory, METADATA), kind="checkpoint", max_bytes=MAX_METADATA_BYTES),
            kind="checkpoint",
            max_int_digits=METADATA_INT_DIGITS,
        )
    except FileFormatError:
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT and isinstance(meta.get("tensors"), dict)


def is_checkpoint_ours(directory: str) -> bool:
    """A complete checkpoint mpipar wrote: a real directory with metadata and (newer saves) the marker."""
    if not _real_dir(directory) or not os.path.exists(os.path.join(directory, METADATA)):
        return False
    return has_marker(directory) or has_our_metadata(directory)


def _leftover_token(base: str, entry: str, tag: str) -> bool:
    rest = entry[len(base) :] if entry.startswith(base) else ""
    return rest.startswith(tag) and _TOKEN.fullmatch(rest[len(tag) :]) is not None


def is_partial_ours(base: str, parent: str, entry: str) -> bool:
    """An interrupted save's leftover ``<base>.partial-<token>``: marked, no metadata."""
    full = os.path.join(parent, entry)
    return (
        _leftover_token(base, entry, PARTIAL_TAG)
        and _real_dir(full)
        and has_marker(full)
        and not os.path.exists(os.path.join(full, METADATA))
    )


def remove_stale_partials(target: str) -> list[str]:
    """Delete the temporary directories earlier interrupted saves to ``target`` left (ours only)."""
    parent, base = os.path.split(target)
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(parent or "."))
    except OSError:
        return removed
    for entry in entries:
        if is_partial_ours(base, parent, entry):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(os.path.join(parent, entry))
    return removed


def is_commit_leftover(base: str, parent: str, entry: str) -> bool:
    """``<base>.replaced-<token>`` / ``<base>.partial-<token>`` holding a complete checkpoint of ours."""
    if not (_leftover_token(base, entry, REPLACED_TAG) or _leftover_token(base, entry, PARTIAL_TAG)):
        return False
    return is_checkpoint_ours(os.path.join(parent, entry))


def lock_path(target: str) -> str:
    parent, base = os.path.split(target)
    return os.path.join(parent, f".{base}{LOCK_SUFFIX}")


class SaveLock:
    """``with SaveLock(target):`` - this process's exclusive right to save to ``target``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.path = lock_path(target)
        self._file: IO[bytes] | None = None

    def __enter__(self) -> SaveLock:
        if fcntl is None:  # pragma: no cover - no flock on this platform
            return self
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for _ in range(100):  # a retry only when a holder removed the file between open and flock
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint save to {self.target}: cannot open its lock file {self.path} ({exc.strerror or exc})"
                ) from None
            f = os.fdopen(fd, "r+b")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                raise CheckpointError(
                    f"checkpoint save to {self.target}: another process is saving to the same path right now "
                    f"(it holds the lock {self.path}); two saves to one path would overwrite each other, so this "
                    "one is refused. Save to another path, or wait for the other save to finish"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
            except OSError:
                same = False
            if same:
                self._file = f
                return self
            f.close()  # we locked a file its previous holder has just unlinked: lock the new one
        raise CheckpointError(f"checkpoint save to {self.target}: could not take the lock {self.path}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._file is not None:
            # Unlink while still holding the lock (a waiter that opened the old file sees it is
            # gone and retries), then release. A killed holder leaves the file, never the lock.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._file.close()
            self._file = None
