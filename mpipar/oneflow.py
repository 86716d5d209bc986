"""OneFlow's spelling, ``from mpipar import oneflow as flow``; the implementation is ``mpipar.compat.oneflow``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.oneflow import *  # noqa: F403
from mpipar.compat.oneflow import __all__  # noqa: F401
