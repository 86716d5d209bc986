"""How a rank waits inside MPI when its host has fewer cores than ranks.

MPICH waits for a message by polling, and between polls only yields the core
(``sched_yield``), which leaves the waiting process runnable: with more ranks than cores, the
ranks that arrived at a collective early keep taking core time from the ranks that have not
arrived yet, so the collective waits longer for exactly the ranks it is waiting for. MPICH's
``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` makes a waiting rank sleep briefly instead. On the 2-core
machine of ``docs/performance.md``, 4 ranks of the TP MLP step, it cut the hand-written
mpi4py step's median by 2.6-2.9x under heavy load, and mpipar's by 1.6-2.6x.

With a dedicated core per rank, polling answers fastest, so nothing changes there.

=====================================  ===============================================
when (before MPI starts)               what
=====================================  ===============================================
ranks on this host > usable cores,     ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` (MPICH reads it
the variable not set                   at ``MPI_Init``; other MPI libraries ignore it)
the variable set (``0`` or ``1``)      left as it is: ``MPIR_CVAR_ENABLE_HEAVY_YIELD=0``
                                       is the opt-out
otherwise                              nothing
=====================================  ===============================================

The host's rank count comes from the launcher (``MPI_LOCALNRANKS`` from MPICH's hydra,
``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI); without one nothing is set.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
LOCAL_RANK_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has affinity
        return os.cpu_count() or 1


def local_ranks(environ: MutableMapping[str, str]) -> int | None:
    """Ranks the launcher started on this host, or None when no launcher says."""
    for name in LOCAL_RANK_VARS:
        raw = environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def prefer_sleeping_waits(environ: MutableMapping[str, str] | None = None, cores: int | None = None) -> bool:
    """Set ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` when this host runs more ranks than it has cores
    and the variable is not set; call before MPI starts. Returns whether it set it."""
    env = os.environ if environ is None else environ
    if HEAVY_YIELD in env:
        return False
    ranks = local_ranks(env)
    if ranks is None or ranks <= (usable_cores() if cores is None else cores):
        return False
    env[HEAVY_YIELD] = "1"
    return True
