"""``fleet.meta_parallel.mp_ops``; the implementation is ``mpipar.compat.fleet.meta_parallel.mp_ops``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.fleet.meta_parallel.mp_ops import *  # noqa: F403
from mpipar.compat.fleet.meta_parallel.mp_ops import __all__  # noqa: F401
