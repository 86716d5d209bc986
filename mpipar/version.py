"""The package version, in its own module so that any module may read it without importing ``mpipar``."""

__version__ = "0.1.0"
