"""The real runtime: one process per rank over MPI (NumPy) or NCCL (CuPy).

* ``mpipar.runtime.mpi``: ``MPIBackend`` / ``MPICommunicator`` on mpi4py buffer methods.
* ``mpipar.runtime.nccl``: ``NCCLBackend`` / ``NCCLCommunicator`` on ``cupy.cuda.nccl``.
* ``mpipar.runtime.ordered``: the collective algorithms both share (reductions run locally,
  in group order, so every backend's results are bit-identical to the simulator's) and the
  cache of result buffers.
* ``mpipar.runtime.faults``: timeouts, the arrival side channel, the collective check mode,
  the abort-on-exception hook.
* ``mpipar.runtime.log``: ``print_once`` and the ``[rank N] `` line prefix.
* ``mpipar.runtime.hosts``: host lists, the rank-to-host map ``mpipar launch`` hands every rank
  (``MPIPAR_HOST_MAP``), the tp-inside-a-host check.
* ``mpipar.runtime.heartbeat``: the rank side of the launcher's heartbeat (``mark_step``).

* ``mpipar.runtime.waits``: how ranks wait inside MPI on a host with fewer cores than ranks
  (``MPIR_CVAR_ENABLE_HEAVY_YIELD``) and the one core each rank runs on there, set here, at
  package import, so that it is in place before MPI starts (``import mpipar`` loads this package: the optimizers import
  ``mpipar.runtime.collector``).
* ``mpipar.runtime.collector``: the garbage collector's one-time freeze after the warm-up
  steps (``MPIPAR_GC``).

Nothing here imports mpi4py or cupy at package import: the backends are loaded by name
(``mpipar/backend.py``) only when an MPI launcher or ``MPIPAR_BACKEND`` selects them.

    mpiexec -n 8 python examples/basics/reshard.py
"""

from mpipar.runtime.waits import bind_to_one_core, prefer_sleeping_waits

# Where a host runs more ranks than it has cores: each rank stays on one core, and MPICH's
# waits sleep instead of spin (both before MPI starts).
bind_to_one_core()
prefer_sleeping_waits()
