"""Counting what a save or load touches on disk: files, chunks and bytes, per hosted rank.

    with mpipar.checkpoint.record_io() as io:
        dist.load_state_dict(state, "ckpt")
    io.files_opened       # data files opened by this process
    io.chunk_reads        # one ChunkRead per chunk read: tensor, file, key, box, bytes, ranks needing it
    io.bytes_read         # data and header bytes read

Tests use it to show that a rank reads only the chunks overlapping its shards; the benchmark
uses it to report bytes moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from mpipar.spec import Box


@dataclass(frozen=True)
class ChunkRead:
    tensor: str
    file: str
    key: str
    box: Box
    nbytes: int
    ranks: tuple[int, ...]
    """The hosted ranks whose shards overlap the chunk (the simulator reads a chunk once for all)."""


@dataclass
class IOStats:
    files_opened: list[str] = field(default_factory=list)
    chunk_reads: list[ChunkRead] = field(default_factory=list)
    bytes_read: int = 0
    files_written: list[str] = field(default_factory=list)
    bytes_written: int = 0

    def chunks_read_by(self, rank: int) -> set[tuple[str, str]]:
        """(tensor, key) of every chunk read on behalf of ``rank``."""
        return {(c.tensor, c.key) for c in self.chunk_reads if rank in c.ranks}


_active: list[IOStats] = []


@contextlib.contextmanager
def record_io() -> Iterator[IOStats]:
    """Record the checkpoint I/O of this process inside the block."""
    stats = IOStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def note_open(path: str, header_bytes: int) -> None:
    for s in _active:
        s.files_opened.append(path)
        s.bytes_read += header_bytes


def note_read(read: ChunkRead) -> None:
    for s in _active:
        s.chunk_reads.append(read)
        s.bytes_read += read.nbytes


def note_write(path: str, nbytes: int) -> None:
    for s in _active:
        s.files_written.append(path)
        s.bytes_written += nbytes
