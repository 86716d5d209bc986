"""``to_static``'s old module path; the implementation is ``mpipar.compile.to_static``."""

from mpipar.compile.to_static import DistModel, Strategy, to_static

__all__ = ["DistModel", "Strategy", "to_static"]
