"""``dist.nn``: layers and the functional API."""

from mpipar.nn import functional

__all__ = ["functional"]
