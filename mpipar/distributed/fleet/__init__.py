"""``paddle.distributed.fleet`` spelled ``mpipar.distributed.fleet``; the implementation is ``mpipar.compat.fleet``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.fleet import *  # noqa: F403
from mpipar.compat.fleet import __all__  # noqa: F401
