"""``fleet.meta_parallel``; the implementation is ``mpipar.compat.fleet.meta_parallel``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.fleet.meta_parallel import *  # noqa: F403
from mpipar.compat.fleet.meta_parallel import __all__  # noqa: F401
