"""``fleet.utils``; the implementation is ``mpipar.compat.fleet.utils``."""

from mpipar.compat.fleet.utils import recompute

__all__ = ["recompute"]
