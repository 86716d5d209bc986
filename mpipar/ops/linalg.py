"""matmul: kernel, gradient in matmuls, and Paddle's eager signature."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpipar._deferred import Product
from mpipar._tape import GradContext
from mpipar.ops import stacked_gemm
from mpipar.ops.creation import _pair
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.ops.manipulation import reduce_to_shape, squeeze, unsqueeze
from mpipar.tensor import Tensor

Array = Any


def _mt(a: Array) -> Array:
    return a.swapaxes(-1, -2)


def _matmul_kernel(
    ctx: KernelContext, x: Array, y: Array, trans_x: bool = False, trans_y: bool = False, **_: Any
) -> Array:
    return ctx.xp.matmul(_mt(x) if trans_x else x, _mt(y) if trans_y else y)


def _matmul_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, y = ctx.inputs
    gout = g[0]
    tx, ty = bool(ctx.attrs.get("trans_x")), bool(ctx.attrs.get("trans_y"))
    gx = gy = None
    # x (m,k) or, transposed, (k,m); y (k,n) or (n,k): each case's adjoint is one matmul.
    if ctx.needs_grad[0]:
        gx = matmul(gout, y, transpose_y=not ty) if not tx else matmul(y, gout, transpose_x=ty, transpose_y=True)
    if ctx.needs_grad[1]:
        gy = matmul(x, gout, transpose_x=not tx) if not ty else matmul(gout, x, transpose_x=True, transpose_y=tx)
    return [reduce_to_shape(gx, ctx.input_shapes[0]), reduce_to_shape(gy, ctx.input_shapes[1])]


def _samples(rng: Any) -> list[tuple[list[Any], dict[str, Any]]]:
    n = rng.standard_normal
    return [
        ([n((4, 6)), n((6, 5))], {"trans_x": False, "trans_y": False}),
        ([n((6, 4)), n((6, 5))], {"trans_x": True, "trans_y": False}),
        ([n((4, 6)), n((5, 6))], {"trans_x": False, "trans_y": True}),
        ([n((6, 4)), n((5, 6))], {"trans_x": True, "trans_y": True}),
        ([n((3, 4, 6)), n((6, 5))], {"trans_x": False, "trans_y": False}),
        ([n((2, 3, 4, 6)), n((3, 6, 5))], {"trans_x": False, "trans_y": False}),
        ([n((2, 1, 4, 6)), n((3, 6, 5))], {"trans_x": False, "trans_y": False}),
    ]


def _matmul_all_pieces(pieces: list[list[Array]], attrs: dict[str, Any]) -> list[Array] | None:
    """Ranks multiplying their own rows by one shared ``y`` (data parallel): one GEMM."""
    y = pieces[0][1]
    if (
        getattr(y, "size", 0) < stacked_gemm.STACK_ELEMENTS
        or attrs.get("trans_x")
        or any(p[1] is not y for p in pieces)
    ):
        return None
    return stacked_gemm.stacked_matmul([p[0] for p in pieces], y, bool(attrs.get("trans_y")))


def _matmul_product_sum(products: Sequence[Product]) -> Array | None:
    """The ranks' products summed in rank order a row tile at a time (data-parallel weight
    gradients: ``x_r.T @ g_r``), never written whole."""
    attrs = products[0].attrs
    pairs = [(p.operands[0], p.operands[1]) for p in products]
    return stacked_gemm.product_sum(pairs, bool(attrs.get("trans_x")), bool(attrs.get("trans_y")), products[0].dtype)


register_op(
    OpDef(
        "matmul",
        _matmul_kernel,
        _matmul_grad,
        sample=_samples,
        all_pieces=_matmul_all_pieces,
        product_sum=_matmul_product_sum,
    )
)


def matmul(x: Any, y: Any, transpose_x: bool = False, transpose_y: bool = False, name: str | None = None) -> Tensor:
    """``x @ y`` with optional transposes of the last two dims; 1-d operands as in NumPy."""
    if isinstance(x, Tensor) and isinstance(y, Tensor) and len(x._shape) > 1 and len(y._shape) > 1:
        # the usual call (two tensors of two or more dims): nothing to convert or squeeze
        return apply("matmul", [x, y], {"trans_x": bool(transpose_x), "trans_y": bool(transpose_y)})
    xt, yt = _pair(x, y)
    if xt.ndim == 0 or yt.ndim == 0:
        raise ValueError(
            f"matmul needs tensors with at least one dim, got shapes {list(xt.shape)} and {list(yt.shape)}"
        )
    squeeze_axes = []
    if xt.ndim == 1:
        xt = unsqueeze(xt, 0)
        transpose_x = False
        squeeze_axes.append(-2)
    if yt.ndim == 1:
        yt = unsqueeze(yt, 1)
        transpose_y = False
        squeeze_axes.append(-1)
    out = apply("matmul", [xt, yt], {"trans_x": bool(transpose_x), "trans_y": bool(transpose_y)})
    if squeeze_axes:
        out = squeeze(out, [a % out.ndim for a in squeeze_axes])
    return out
