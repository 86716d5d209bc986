"""Built-in SPMD rules; importing this package registers them all."""

from mpipar.spmd.rules import attention, elementwise, manipulation, matmul, nn, reduction, transformer  # noqa: F401
