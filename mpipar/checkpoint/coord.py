"""Coordination of the ranks taking part in a save or a load, through ``backend.comm`` only.

The Communicator interface moves arrays, not objects, so everything exchanged here is a small
int64 or uint8 array: a random token naming the temporary directory, the checksums each
writer computed, and error texts (UTF-8 bytes). Every step that can fail on one rank is
followed by ``agree``, a collective in which every rank learns every other rank's error, so
all of them raise together instead of some waiting forever in the next collective.

In the reference mode (one big device, no communicator) the process is the whole world and
everything is local.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import numpy as np

from mpipar._modes import Mode, execution_mode
from mpipar.backend import Backend
from mpipar.checkpoint.format import CheckpointError
from mpipar.comm import comm_context


class Coordinator:
    """Collectives over the world group for one save or load."""

    def __init__(self, backend: Backend, label: str) -> None:
        self.backend = backend
        self.label = label
        self.world = tuple(backend.world_group())
        self.hosted = tuple(r for r in self.world if backend.hosts(r))
        self.local = execution_mode((), backend) is Mode.DENSE or backend.comm.name == "none"
        self.leader = self.world[0]

    @property
    def is_leader(self) -> bool:
        return self.leader in self.hosted

    def gather(self, per_rank: Mapping[int, np.ndarray], dtype: type) -> list[np.ndarray]:
        """Every rank's 1-d array (of any length), in world order, on every rank."""
        if self.local:
            return [np.asarray(per_rank[r], dtype=dtype) for r in self.world]
        comm = self.backend.comm
        with comm_context(self.label):
            lengths = comm.all_gather(
                self.world,
                {r: np.array([len(per_rank[r])], dtype=np.int64) for r in self.hosted},
                [(1,)] * len(self.world),
            )
            sizes = [int(a[0]) for a in next(iter(lengths.values()))]
            got = comm.all_gather(
                self.world,
                {r: np.ascontiguousarray(per_rank[r], dtype=dtype) for r in self.hosted},
                [(n,) for n in sizes],
            )
        return [np.asarray(a) for a in next(iter(got.values()))]

    def token(self) -> int:
        """A random 62-bit number, the same on every rank (names the temporary directory)."""
        mine = {r: np.array([secrets.randbits(62) if r == self.leader else 0], dtype=np.int64) for r in self.hosted}
        return int(self.gather(mine, np.int64)[0][0])

    def agree(self, error: BaseException | None) -> list[tuple[int, str]]:
        """Share this process's error (if any); every rank gets the list of (rank, message)."""
        text = "" if error is None else f"{type(error).__name__}: {error}"
        # A process hosting several ranks (the simulator) reports its error once, on its first rank.
        per_rank = {
            r: np.frombuffer(text.encode("utf-8") if r == self.hosted[0] else b"", dtype=np.uint8) for r in self.hosted
        }
        got = self.gather(per_rank, np.uint8)
        return [(r, bytes(a).decode("utf-8", "replace")) for r, a in zip(self.world, got, strict=True) if a.size]

    def raise_if_failed(self, error: BaseException | None, what: str) -> None:
        """``agree`` and raise on every rank when any failed (the local exception where it is local)."""
        failures = self.agree(error)
        if not failures:
            return
        if error is not None:
            raise error
        rank, msg = failures[0]
        raise CheckpointError(f"{what} failed on rank {rank}: {msg}")
