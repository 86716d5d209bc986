"""``fleet.meta_parallel.mp_ops``; the implementation is ``mpipar.compat.fleet.meta_parallel.mp_ops``."""

from mpipar.compat.fleet.meta_parallel.mp_ops import c_concat, c_identity, c_split, mp_allreduce

__all__ = ["c_concat", "c_identity", "c_split", "mp_allreduce"]
