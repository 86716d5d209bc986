"""Distributed ops: kernels, gradients and Paddle-style eager functions."""

from mpipar.ops import attention, linalg, manipulation, math, nn_ops, tensor_methods, transformer  # noqa: F401  (register every op)
from mpipar.ops.dispatch import KernelContext, OpDef, apply, get_op, register_op, registered_ops

__all__ = ["KernelContext", "OpDef", "apply", "get_op", "register_op", "registered_ops"]
