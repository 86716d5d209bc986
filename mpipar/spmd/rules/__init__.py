"""Built-in SPMD rules; importing this package registers them all."""

from mpipar.spmd.rules import elementwise, manipulation, matmul, nn, reduction  # noqa: F401
