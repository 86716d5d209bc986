"""Operators and methods of ``Tensor`` (``x + y``, ``x @ w``, ``x.sum()``, ``x[0]``...).

Installed on the class when mpipar.ops loads, as Paddle patches its Tensor, so that
``tensor.py`` (storage and layout) does not depend on the ops built on top of it.
"""

from __future__ import annotations

from typing import Any

from mpipar.ops import linalg, manipulation
from mpipar.ops import math as M
from mpipar.tensor import Tensor


def _binary(fn: Any, reverse: bool = False) -> Any:
    def method(self: Tensor, other: Any) -> Tensor:
        return fn(other, self) if reverse else fn(self, other)

    return method


# Set with ``setattr`` from one table: ``Tensor`` declares none of these, and a type checker
# reads a plain ``Tensor.__add__ = ...`` as assigning to a method it does not know.
_METHODS: dict[str, Any] = {
    "__add__": _binary(M.add),
    "__radd__": _binary(M.add, True),
    "__sub__": _binary(M.subtract),
    "__rsub__": _binary(M.subtract, True),
    "__mul__": _binary(M.multiply),
    "__rmul__": _binary(M.multiply, True),
    "__truediv__": _binary(M.divide),
    "__rtruediv__": _binary(M.divide, True),
    "__matmul__": _binary(linalg.matmul),
    "__rmatmul__": _binary(linalg.matmul, True),
    "__neg__": lambda self: M.neg(self),
    "__pow__": lambda self, y: M.pow_(self, y),
    "__gt__": _binary(M.greater_than),
    "__lt__": _binary(M.less_than),
    "__ge__": _binary(M.greater_equal),
    "__le__": _binary(M.less_equal),
    "__getitem__": manipulation.getitem,
    "matmul": lambda self, y, transpose_x=False, transpose_y=False: linalg.matmul(self, y, transpose_x, transpose_y),
    "sum": lambda self, axis=None, dtype=None, keepdim=False: M.sum_(self, axis, dtype, keepdim),
    "mean": lambda self, axis=None, keepdim=False: M.mean(self, axis, keepdim),
    "max": lambda self, axis=None, keepdim=False: M.max_(self, axis, keepdim),
    "min": lambda self, axis=None, keepdim=False: M.min_(self, axis, keepdim),
    "reshape": lambda self, *shape: manipulation.reshape(
        self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
    ),
    "transpose": lambda self, perm: manipulation.transpose(self, perm),
    "unsqueeze": lambda self, axis: manipulation.unsqueeze(self, axis),
    "squeeze": lambda self, axis=None: manipulation.squeeze(self, axis),
    "astype": lambda self, dtype: M.cast(self, dtype),
    "exp": lambda self: M.exp(self),
    "log": lambda self: M.log(self),
    "sqrt": lambda self: M.sqrt(self),
    "tanh": lambda self: M.tanh(self),
    "abs": lambda self: M.abs_(self),
    "scale": lambda self, scale=1.0, bias=0.0: M.scale(self, scale, bias),
    "T": property(lambda self: manipulation.transpose(self, list(range(self.ndim))[::-1])),
}
_METHODS["cast"] = _METHODS["astype"]


def _install() -> None:
    for name, method in _METHODS.items():
        setattr(Tensor, name, method)


_install()
