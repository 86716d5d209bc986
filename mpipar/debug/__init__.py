"""Tools that observe a run without changing it.

* ``mpipar.debug.comm_mode``: ``CommDebugMode`` (public as ``dist.CommDebugMode``).
* ``mpipar.debug.memory``: ``memory_report`` and what the tape keeps for backward.
* ``mpipar.debug.timeline``: the ``Timeline`` value and its ``mpipar.timeline`` JSON / Chrome trace.
* ``mpipar.debug.measured``: measured timelines (``MPIPAR_TRACE=file``);
  ``python -m mpipar.debug.measured file --chrome trace.json``.
"""

from mpipar.debug.comm_mode import CommDebugMode

__all__ = ["CommDebugMode"]
