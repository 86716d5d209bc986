"""``fleet.utils``; the implementation is ``mpipar.compat.fleet.utils``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.fleet.utils import *  # noqa: F403
from mpipar.compat.fleet.utils import __all__  # noqa: F401
