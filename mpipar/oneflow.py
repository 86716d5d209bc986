"""OneFlow's spelling, ``from mpipar import oneflow as flow``; the implementation is ``mpipar.compat.oneflow``."""

from mpipar.compat.oneflow import (
    gelu,
    manual_seed,
    matmul,
    ones,
    optim,
    placement,
    randn,
    relu,
    sbp,
    tensor,
    to_global,
    to_local,
    zeros,
)

__all__ = [
    "gelu",
    "manual_seed",
    "matmul",
    "ones",
    "optim",
    "placement",
    "randn",
    "relu",
    "sbp",
    "tensor",
    "to_global",
    "to_local",
    "zeros",
]
