"""``fleet.utils``: Paddle's helpers that fleet scripts import from here."""

from mpipar.recompute import recompute

__all__ = ["recompute"]
