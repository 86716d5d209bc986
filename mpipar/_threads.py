"""Limit BLAS/OpenMP threads to one per rank under an MPI launcher, before NumPy loads.

With default threading, 8 ranks on 2 cores oversubscribe by 8x and run about 100x slower.
Imported first by ``mpipar/__init__``; ``limit_loaded_blas`` covers scripts that imported
NumPy before mpipar.
"""

from __future__ import annotations

import os

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
_MPI_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def under_mpi_launcher() -> bool:
    return any(v in os.environ for v in _MPI_VARS)


def limit_threads_env() -> None:
    if under_mpi_launcher():
        for var in _THREAD_VARS:
            os.environ.setdefault(var, "1")


def limit_loaded_blas() -> None:
    """If NumPy's BLAS is already loaded, cap its pool at one thread (MPI runs only)."""
    if not under_mpi_launcher():
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=1)


limit_threads_env()
