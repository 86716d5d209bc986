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


def _install() -> None:
    T = Tensor
    T.__add__ = _binary(M.add)  # type: ignore[method-assign]
    T.__radd__ = _binary(M.add, True)  # type: ignore[method-assign]
    T.__sub__ = _binary(M.subtract)  # type: ignore[method-assign]
    T.__rsub__ = _binary(M.subtract, True)  # type: ignore[method-assign]
    T.__mul__ = _binary(M.multiply)  # type: ignore[method-assign]
    T.__rmul__ = _binary(M.multiply, True)  # type: ignore[method-assign]
    T.__truediv__ = _binary(M.divide)  # type: ignore[method-assign]
    T.__rtruediv__ = _binary(M.divide, True)  # type: ignore[method-assign]
    T.__matmul__ = _binary(linalg.matmul)  # type: ignore[method-assign]
    T.__rmatmul__ = _binary(linalg.matmul, True)  # type: ignore[method-assign]
    T.__neg__ = lambda self: M.neg(self)  # type: ignore[method-assign]
    T.__pow__ = lambda self, y: M.pow_(self, y)  # type: ignore[method-assign]
    T.__gt__ = _binary(M.greater_than)  # type: ignore[method-assign]
    T.__lt__ = _binary(M.less_than)  # type: ignore[method-assign]
    T.__ge__ = _binary(M.greater_equal)  # type: ignore[method-assign]
    T.__le__ = _binary(M.less_equal)  # type: ignore[method-assign]
    T.__getitem__ = manipulation.getitem  # type: ignore[method-assign]
    T.matmul = lambda self, y, transpose_x=False, transpose_y=False: linalg.matmul(self, y, transpose_x, transpose_y)  # type: ignore[attr-defined]
    T.sum = lambda self, axis=None, dtype=None, keepdim=False: M.sum_(self, axis, dtype, keepdim)  # type: ignore[attr-defined]
    T.mean = lambda self, axis=None, keepdim=False: M.mean(self, axis, keepdim)  # type: ignore[attr-defined]
    T.max = lambda self, axis=None, keepdim=False: M.max_(self, axis, keepdim)  # type: ignore[attr-defined]
    T.min = lambda self, axis=None, keepdim=False: M.min_(self, axis, keepdim)  # type: ignore[attr-defined]
    T.reshape = lambda self, *shape: manipulation.reshape(
        self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
    )  # type: ignore[attr-defined]
    T.transpose = lambda self, perm: manipulation.transpose(self, perm)  # type: ignore[attr-defined]
    T.unsqueeze = lambda self, axis: manipulation.unsqueeze(self, axis)  # type: ignore[attr-defined]
    T.squeeze = lambda self, axis=None: manipulation.squeeze(self, axis)  # type: ignore[attr-defined]
    T.astype = lambda self, dtype: M.cast(self, dtype)  # type: ignore[attr-defined]
    T.cast = T.astype  # type: ignore[attr-defined]
    T.exp = lambda self: M.exp(self)  # type: ignore[attr-defined]
    T.log = lambda self: M.log(self)  # type: ignore[attr-defined]
    T.sqrt = lambda self: M.sqrt(self)  # type: ignore[attr-defined]
    T.tanh = lambda self: M.tanh(self)  # type: ignore[attr-defined]
    T.abs = lambda self: M.abs_(self)  # type: ignore[attr-defined]
    T.scale = lambda self, scale=1.0, bias=0.0: M.scale(self, scale, bias)  # type: ignore[attr-defined]
    T.T = property(lambda self: manipulation.transpose(self, list(range(self.ndim))[::-1]))  # type: ignore[attr-defined]


_install()
