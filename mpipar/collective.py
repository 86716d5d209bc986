"""Paddle's manual collectives (``from mpipar.collective import ...``); the implementation is
``mpipar.compat.collective``.

A thin public path: every name of the implementation's ``__all__``, nothing of its own."""

from mpipar.compat.collective import *  # noqa: F403
from mpipar.compat.collective import __all__  # noqa: F401
