"""How a rank waits inside MPI, and where it runs, when its host has fewer cores than ranks.

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

**Where a rank runs** (``bind_to_one_core``). On such a host each rank is also kept on one
core: local rank ``i`` on the ``i % cores``-th core it may use (what ``mpiexec -bind-to core``
does). Left free, the ranks that wake from a collective land on whichever core is free and
find its caches full of another rank's data; kept in place, two ranks share one core's caches
and nothing migrates. On the TP MLP step (4 ranks, 2 cores) the spread of step times
(p90 / p50) fell from 1.27-1.40 to 1.08-1.25 for mpipar and the hand-written step alike, and
the median by 2-8% (``docs/performance.md``). Nothing is done where the launcher already bound
the rank (it may use fewer cores than the host has), where no launcher names the local rank,
or with ``MPIPAR_BIND_CORES=0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping

from mpipar.env import env_flag

HEAVY_YIELD = "MPIR_CVAR_ENABLE_HEAVY_YIELD"
LOCAL_RANK_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
LOCAL_RANK_ID_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
BIND_ENV = "MPIPAR_BIND_CORES"


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not every platform has affinity
        return os.cpu_count() or 1


def _launcher_number(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def local_ranks(environ: Mapping[str, str]) -> int | None:
    """Ranks the launcher started on this host, or None when no launcher says."""
    return _launcher_number(environ, LOCAL_RANK_VARS)


def local_rank(environ: Mapping[str, str]) -> int | None:
    """This rank's index among the ranks on its host, or None when no launcher says."""
    return _launcher_number(environ, LOCAL_RANK_ID_VARS)


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


def bind_to_one_core(
    environ: Mapping[str, str] | None = None,
    allowed: set[int] | None = None,
    bind: Callable[[set[int]], None] | None = None,
) -> int | None:
    """Keep this rank on one core when its host runs more ranks than the cores it may use:
    local rank ``i`` on the ``i % n``-th of those ``n`` cores (in order). Call before MPI
    starts. Returns the core, or None when nothing was done: no launcher names this rank's
    place, a core per rank, the launcher already bound it to one core, ``MPIPAR_BIND_CORES=0``,
    or a platform without affinity. (``allowed`` and ``bind`` stand in for the process's
    affinity in tests.)"""
    env = os.environ if environ is None else environ
    if not env_flag(BIND_ENV, True, env):
        return None
    ranks, me = local_ranks(env), local_rank(env)
    if ranks is None or me is None:
        return None
    if allowed is None:
        try:
            allowed = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not every platform has affinity
            return None
    if len(allowed) <= 1 or ranks <= len(allowed):
        return None
    core = sorted(allowed)[me % len(allowed)]
    try:
        (bind or _bind_self)({core})
    except OSError:  # (a container may refuse it: the rank then runs where the kernel puts it)
        return None
    return core


def _bind_self(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)
