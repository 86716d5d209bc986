"""Elementwise math and reductions: kernels, gradients (in mpipar ops) and eager functions.

Eager functions take Paddle's signatures and accept dense or distributed tensors, NumPy
arrays and Python numbers. A Python number takes the dtype of the tensor it meets, so
``x * 0.5`` stays float32 for a float32 ``x`` (NumPy 2 would otherwise promote to float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar._tape import GradContext
from mpipar._xp import extreme
from mpipar.comm import comm_context
from mpipar.distribute import reshard
from mpipar.ops.creation import _pair, as_tensor, ones_like_global, zeros_like_global  # noqa: F401  (re-exported)
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.ops.manipulation import expand, reduce_to_shape, reshape
from mpipar.spmd.rules.common import norm_axes
from mpipar.tensor import Tensor

Array = Any


# ----------------------------------------------------------------------------- conversions
def _bool(dt: Sequence[Any], a: dict[str, Any]) -> list[Any]:
    return [np.bool_]


def _float_like(dt: Sequence[Any], a: dict[str, Any]) -> list[Any]:
    d = np.result_type(*dt)
    return [d if np.issubdtype(d, np.floating) else np.float64]


def _samples_binary(rng: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    return [
        ([rng.standard_normal((5, 6)), rng.standard_normal((5, 6))], {}),
        ([rng.standard_normal((4, 7)), rng.standard_normal((7,))], {}),
        ([rng.standard_normal((3, 1, 5)), rng.standard_normal((4, 5))], {}),
        ([rng.standard_normal((6, 4)), rng.standard_normal((6, 1))], {}),
    ]


def _samples_unary(rng: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    return [([rng.standard_normal(s)], {}) for s in [(5, 6), (3, 4, 5), (7,)]]


def _samples_positive(rng: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    return [([rng.random(s) + 0.5], {}) for s in [(5, 6), (3, 4, 5)]]


# ----------------------------------------------------------------------------- binary ops
def _add_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    return [reduce_to_shape(g[0], ctx.input_shapes[0]), reduce_to_shape(g[0], ctx.input_shapes[1])]


def _same_value(x: Any, y: Any) -> bool:
    """Do saved inputs ``x`` and ``y`` hold one value in one layout (an op applied to a tensor
    and itself)? Then a product with either gives the same bits. (One storage id is one value,
    so one dtype and shape.)"""
    return x is not None and y is not None and x._sid == y._sid and x._spec == y._spec


def _sub_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    gy = neg(g[0]) if ctx.needs_grad[1] else None
    return [reduce_to_shape(g[0], ctx.input_shapes[0]), reduce_to_shape(gy, ctx.input_shapes[1])]


def _mul_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, y = ctx.inputs
    gx = multiply(g[0], y) if ctx.needs_grad[0] else None
    # a square (``z * z``): both gradients are the same product, made once
    square = gx is not None and _same_value(x, y)
    gy = gx if square else multiply(g[0], x) if ctx.needs_grad[1] else None
    return [reduce_to_shape(gx, ctx.input_shapes[0]), reduce_to_shape(gy, ctx.input_shapes[1])]


def _div_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, y = ctx.inputs
    gx = divide(g[0], y) if ctx.needs_grad[0] else None
    gy = neg(divide(multiply(g[0], x), multiply(y, y))) if ctx.needs_grad[1] else None
    return [reduce_to_shape(gx, ctx.input_shapes[0]), reduce_to_shape(gy, ctx.input_shapes[1])]


def _minmax_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, y = ctx.inputs
    pick_x = greater_equal(x, y) if ctx.op == "maximum" else less_equal(x, y)
    zero = as_tensor(0.0, g[0])
    gx = where(pick_x, g[0], zero) if ctx.needs_grad[0] else None
    gy = where(pick_x, zero, g[0]) if ctx.needs_grad[1] else None
    return [reduce_to_shape(gx, ctx.input_shapes[0]), reduce_to_shape(gy, ctx.input_shapes[1])]


register_op(OpDef("add", lambda c, x, y, **_: x + y, _add_grad, save_inputs=(), sample=_samples_binary))
register_op(OpDef("subtract", lambda c, x, y, **_: x - y, _sub_grad, save_inputs=(), sample=_samples_binary))
register_op(OpDef("multiply", lambda c, x, y, **_: x * y, _mul_grad, sample=_samples_binary))
register_op(
    OpDef(
        "divide",
        lambda c, x, y, **_: x / y,
        _div_grad,
        sample=lambda r: [
            ([r.standard_normal((5, 6)), r.random((5, 6)) + 0.5], {}),
            ([r.standard_normal((4, 7)), r.random((7,)) + 0.5], {}),
        ],
    )
)
register_op(OpDef("maximum", lambda c, x, y, **_: c.xp.maximum(x, y), _minmax_grad, sample=_samples_binary))
register_op(OpDef("minimum", lambda c, x, y, **_: c.xp.minimum(x, y), _minmax_grad, sample=_samples_binary))


def _where_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    cond = ctx.inputs[0]
    zero = as_tensor(0.0, g[0])
    gx = where(cond, g[0], zero) if ctx.needs_grad[1] else None
    gy = where(cond, zero, g[0]) if ctx.needs_grad[2] else None
    return [None, reduce_to_shape(gx, ctx.input_shapes[1]), reduce_to_shape(gy, ctx.input_shapes[2])]


register_op(
    OpDef(
        "where",
        lambda c, cond, x, y, **_: c.xp.where(cond, x, y),
        _where_grad,
        dtype=lambda dt, a: [np.result_type(dt[1], dt[2])],
        save_inputs=(0,),
        differentiable=(1, 2),
        sample=lambda r: [
            ([r.random((5, 6)) > 0.5, r.standard_normal((5, 6)), r.standard_normal((5, 6))], {}),
            ([r.random((4, 7)) > 0.5, r.standard_normal((4, 7)), r.standard_normal((7,))], {}),
        ],
    )
)

for _name, _fn in {
    "greater_than": np.greater,
    "less_than": np.less,
    "greater_equal": np.greater_equal,
    "less_equal": np.less_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
}.items():
    register_op(OpDef(_name, lambda c, x, y, _f=_fn, **_: _f(x, y), None, dtype=_bool, sample=_samples_binary))


# ----------------------------------------------------------------------------- unary ops
def _unary_grad(fn: Any) -> Any:
    def grad(ctx: GradContext, g: list[Any]) -> list[Any]:
        return [fn(ctx, g[0])]

    return grad


register_op(OpDef("neg", lambda c, x, **_: -x, _unary_grad(lambda c, g: neg(g)), save_inputs=(), sample=_samples_unary))
register_op(
    OpDef(
        "scale",
        lambda c, x, scale=1.0, bias=0.0, **_: (
            x * x.dtype.type(scale) + x.dtype.type(bias) if bias else x * x.dtype.type(scale)
        ),
        _unary_grad(lambda c, g: scale(g, c.attrs.get("scale", 1.0))),
        save_inputs=(),
        rule_attrs=(),
        sample=lambda r: [([r.standard_normal((5, 6))], {"scale": 2.5}), ([r.standard_normal((4,))], {"scale": -0.5})],
    )
)
register_op(
    OpDef(
        "exp",
        lambda c, x, **_: c.xp.exp(x),
        _unary_grad(lambda c, g: multiply(g, c.outputs[0])),
        save_inputs=(),
        save_outputs=(0,),
        sample=_samples_unary,
    )
)
register_op(
    OpDef(
        "log", lambda c, x, **_: c.xp.log(x), _unary_grad(lambda c, g: divide(g, c.inputs[0])), sample=_samples_positive
    )
)
register_op(
    OpDef(
        "tanh",
        lambda c, x, **_: c.xp.tanh(x),
        _unary_grad(lambda c, g: apply("tanh_grad", [c.outputs[0], g])),
        save_inputs=(),
        save_outputs=(0,),
        sample=_samples_unary,
    )
)
register_op(
    OpDef(
        "tanh_grad",
        lambda c, y, g, **_: g * (1 - y * y),
        None,
        differentiable=(),
        sample=lambda r: [([r.standard_normal((4, 5)), r.standard_normal((4, 5))], {})],
    )
)
register_op(
    OpDef(
        "sqrt",
        lambda c, x, **_: c.xp.sqrt(x),
        _unary_grad(lambda c, g: apply("sqrt_grad", [c.outputs[0], g])),
        save_inputs=(),
        save_outputs=(0,),
        sample=_samples_positive,
    )
)
register_op(
    OpDef(
        "sqrt_grad",
        lambda c, y, g, **_: g * (0.5 / y).astype(g.dtype, copy=False),
        None,
        sample=lambda r: [([r.random((4, 5)) + 0.5, r.standard_normal((4, 5))], {})],
    )
)
register_op(
    OpDef(
        "rsqrt",
        lambda c, x, **_: 1 / c.xp.sqrt(x),
        _unary_grad(lambda c, g: multiply(g, scale(pow_(c.outputs[0], 3.0), -0.5))),
        save_inputs=(),
        save_outputs=(0,),
        sample=_samples_positive,
    )
)
register_op(
    OpDef(
        "sigmoid",
        lambda c, x, **_: 1 / (1 + c.xp.exp(-x)),
        _unary_grad(lambda c, g: apply("sigmoid_grad", [c.outputs[0], g])),
        save_inputs=(),
        save_outputs=(0,),
        sample=_samples_unary,
    )
)
register_op(
    OpDef(
        "sigmoid_grad",
        lambda c, y, g, **_: g * y * (1 - y),
        None,
        sample=lambda r: [([r.random((4, 5)), r.standard_normal((4, 5))], {})],
    )
)
register_op(
    OpDef(
        "abs",
        lambda c, x, **_: c.xp.abs(x),
        _unary_grad(lambda c, g: multiply(g, sign(c.inputs[0]))),
        sample=_samples_unary,
    )
)
register_op(OpDef("sign", lambda c, x, **_: c.xp.sign(x), None, rule="abs", sample=_samples_unary))
register_op(
    OpDef(
        "square",
        lambda c, x, **_: x * x,
        _unary_grad(lambda c, g: multiply(g, scale(c.inputs[0], 2.0))),
        sample=_samples_unary,
    )
)
register_op(
    OpDef(
        "pow",
        lambda c, x, factor=1.0, **_: x ** x.dtype.type(factor) if np.issubdtype(x.dtype, np.floating) else x**factor,
        _unary_grad(lambda c, g: apply("pow_grad", [c.inputs[0], g], {"factor": c.attrs.get("factor", 1.0)})),
        rule_attrs=(),
        sample=lambda r: [([r.random((5, 6)) + 0.5], {"factor": 3.0}), ([r.random((4,)) + 0.5], {"factor": 0.5})],
    )
)
register_op(
    OpDef(
        "pow_grad",
        lambda c, x, g, factor=1.0, **_: g * x.dtype.type(factor) * x ** x.dtype.type(factor - 1),
        None,
        rule_attrs=(),
        sample=lambda r: [([r.random((4, 5)) + 0.5, r.standard_normal((4, 5))], {"factor": 2.0})],
    )
)
register_op(
    OpDef(
        "cast",
        lambda c, x, dtype=None, **_: x.astype(dtype),
        _unary_grad(lambda c, g: cast(g, c.input_dtypes[0])),
        dtype=lambda dt, a: [a["dtype"]],
        save_inputs=(),
        rule_attrs=(),
        sample=lambda r: [([r.standard_normal((5, 6))], {"dtype": np.float32})],
    )
)
register_op(
    OpDef("assign", lambda c, x, **_: x.copy(), _unary_grad(lambda c, g: g), save_inputs=(), sample=_samples_unary)
)
register_op(OpDef("isfinite", lambda c, x, **_: c.xp.isfinite(x), None, dtype=_bool, sample=_samples_unary))


# ----------------------------------------------------------------------------- reductions
def _red_axes(ctx: KernelContext, axis: Any) -> tuple[int, ...]:
    return norm_axes(axis, len(ctx.in_shape(0)), "reduction")


def _summed(ctx: KernelContext, x: Array, axes: tuple[int, ...], keepdim: bool) -> Array:
    """``xp.sum(x, axis=axes, keepdims=keepdim)``. For a plain NumPy array, the reduction
    ``np.sum`` itself makes for one (``np.add.reduce``, the same call and the same bits), without
    its Python wrapper: every step's bias gradients and loss run it."""
    if type(x) is np.ndarray:
        return np.add.reduce(x, axis=axes, keepdims=True) if keepdim else np.add.reduce(x, axis=axes)
    return ctx.xp.sum(x, axis=axes, keepdims=keepdim)


def _sum_kernel(ctx: KernelContext, x: Array, axis: Any = None, keepdim: bool = False, **_: Any) -> Array:
    return _summed(ctx, x, _red_axes(ctx, axis), keepdim)


def _mean_kernel(ctx: KernelContext, x: Array, axis: Any = None, keepdim: bool = False, **_: Any) -> Array:
    axes = _red_axes(ctx, axis)
    # The global count, so a split reduced dim gives the right Partial(sum) contribution.
    count = math.prod(ctx.in_shape(0)[a] for a in axes)
    s = _summed(ctx, x, axes, keepdim)
    kind = s.dtype.kind  # "f": NumPy's floating types, asked first (``issubdtype`` costs more than the sum here)
    floating = kind == "f" or (kind not in "biucmMOSU" and np.issubdtype(s.dtype, np.floating))
    return s / s.dtype.type(count) if floating else s / count


def _extreme_kernel(op: str) -> Any:
    def kernel(ctx: KernelContext, x: Array, axis: Any = None, keepdim: bool = False, **_: Any) -> Array:
        axes = _red_axes(ctx, axis)
        if np.issubdtype(x.dtype, np.floating):
            init = -np.inf if op == "max" else np.inf
        else:
            info = np.iinfo(x.dtype)
            init = info.min if op == "max" else info.max
        # ``initial`` makes an empty shard (more ranks than elements) contribute the identity.
        return extreme(x, op, axes, keepdim, init)

    return kernel


def _keep_shape(shape: Sequence[int], axis: Any) -> list[int]:
    axes = norm_axes(axis, len(shape), "reduction")
    return [1 if d in axes else n for d, n in enumerate(shape)]


def _split_like_input(ctx: GradContext, g: Tensor) -> Tensor:
    """The broadcast gradient of a reduction, split where the reduced input was split.

    ``expand`` of a replicated gradient is replicated: left so, every rank would carry (and the
    next matmul would compute on) the whole tensor although the input was, say, split by batch.
    Where the input is ``Shard`` and the gradient ``Replicate``, taking this rank's part is a
    local slice of a broadcast view: no communication, no copy, the same values.
    """
    spec = ctx.input_specs[0] if ctx.input_specs else None
    if spec is None or not g.is_dist or g.spec.mesh != spec.mesh:
        return g
    want = [
        p if p.is_shard() and q.is_replicated() else q for p, q in zip(spec.placements, g.spec.placements, strict=True)
    ]
    if want == list(g.spec.placements):
        return g
    with comm_context(f"{ctx.op} gradient: split like its input {spec.placements_str}"):
        return reshard(g, spec.mesh, want)


def _kept_dims(g: Tensor, shape: Sequence[int], axis: Any) -> Tensor:
    """A reduction's gradient with the reduced dims back as size 1, ready to expand; a 0-d one
    (every dim reduced) expands as it is (broadcasting adds the dims: one op fewer)."""
    return g if g.ndim == 0 else reshape(g, _keep_shape(shape, axis))


def _sum_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    shape = ctx.input_shapes[0]
    gk = _kept_dims(g[0], shape, ctx.attrs.get("axis"))
    return [_split_like_input(ctx, expand(gk, list(shape)))]


def _mean_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    shape = ctx.input_shapes[0]
    axis = ctx.attrs.get("axis")
    # Every dim reduced (a loss): the count is every element, and the 0-d gradient expands as it is.
    count = math.prod(shape) if axis is None else math.prod(shape[a] for a in norm_axes(axis, len(shape), "mean"))
    gk = _kept_dims(scale(g[0], 1.0 / count), shape, axis)
    return [_split_like_input(ctx, expand(gk, list(shape)))]


def _extreme_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x = ctx.inputs[0]
    out = ctx.outputs[0]
    assert x is not None and out is not None, "max/min keep their input and output for backward"
    keep = _keep_shape(ctx.input_shapes[0], ctx.attrs.get("axis"))
    hit = cast(equal(x, reshape(out, keep)), x.dtype)
    # Ties share the gradient equally.
    ties = sum_(hit, axis=ctx.attrs.get("axis"), keepdim=True)
    return [multiply(divide(hit, ties), reshape(g[0], keep))]


def _red_samples(rng: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    x = rng.standard_normal((4, 5, 6))
    return [
        ([x], {"axis": None, "keepdim": False}),
        ([x], {"axis": 1, "keepdim": False}),
        ([x], {"axis": [0, 2], "keepdim": True}),
        ([x], {"axis": -1, "keepdim": True}),
        ([rng.standard_normal((7,))], {"axis": 0, "keepdim": False}),
    ]


_RED_ATTRS = ("axis", "keepdim")
register_op(OpDef("sum", _sum_kernel, _sum_grad, save_inputs=(), rule_attrs=_RED_ATTRS, sample=_red_samples))
register_op(
    OpDef(
        "mean", _mean_kernel, _mean_grad, save_inputs=(), rule_attrs=_RED_ATTRS, dtype=_float_like, sample=_red_samples
    )
)
register_op(
    OpDef("max", _extreme_kernel("max"), _extreme_grad, save_outputs=(0,), rule_attrs=_RED_ATTRS, sample=_red_samples)
)
register_op(
    OpDef("min", _extreme_kernel("min"), _extreme_grad, save_outputs=(0,), rule_attrs=_RED_ATTRS, sample=_red_samples)
)


# ----------------------------------------------------------------------------- eager API
def add(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("add", _pair(x, y))


def subtract(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("subtract", _pair(x, y))


def multiply(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("multiply", _pair(x, y))


def divide(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("divide", _pair(x, y))


def maximum(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("maximum", _pair(x, y))


def minimum(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("minimum", _pair(x, y))


def where(condition: Any, x: Any, y: Any, name: str | None = None) -> Tensor:
    xt, yt = _pair(x, y)
    return apply("where", [as_tensor(condition), xt, yt])


def greater_than(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("greater_than", _pair(x, y))


def less_than(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("less_than", _pair(x, y))


def greater_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("greater_equal", _pair(x, y))


def less_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("less_equal", _pair(x, y))


def equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("equal", _pair(x, y))


def not_equal(x: Any, y: Any, name: str | None = None) -> Tensor:
    return apply("not_equal", _pair(x, y))


def neg(x: Any) -> Tensor:
    return apply("neg", [as_tensor(x)])


def scale(x: Any, scale: float = 1.0, bias: float = 0.0, name: str | None = None) -> Tensor:
    return apply("scale", [as_tensor(x)], {"scale": float(scale), "bias": float(bias)})


def exp(x: Any, name: str | None = None) -> Tensor:
    return apply("exp", [as_tensor(x)])


def log(x: Any, name: str | None = None) -> Tensor:
    return apply("log", [as_tensor(x)])


def tanh(x: Any, name: str | None = None) -> Tensor:
    return apply("tanh", [as_tensor(x)])


def sqrt(x: Any, name: str | None = None) -> Tensor:
    return apply("sqrt", [as_tensor(x)])


def rsqrt(x: Any, name: str | None = None) -> Tensor:
    return apply("rsqrt", [as_tensor(x)])


def sigmoid(x: Any, name: str | None = None) -> Tensor:
    return apply("sigmoid", [as_tensor(x)])


def abs_(x: Any, name: str | None = None) -> Tensor:
    return apply("abs", [as_tensor(x)])


def sign(x: Any, name: str | None = None) -> Tensor:
    return apply("sign", [as_tensor(x)])


def square(x: Any, name: str | None = None) -> Tensor:
    return apply("square", [as_tensor(x)])


def pow_(x: Any, y: float, name: str | None = None) -> Tensor:
    return apply("pow", [as_tensor(x)], {"factor": float(y)})


def cast(x: Any, dtype: Any) -> Tensor:
    t = as_tensor(x)
    dtype = np.dtype(dtype)
    return t if t.dtype == dtype else apply("cast", [t], {"dtype": dtype})


def assign(x: Any) -> Tensor:
    return apply("assign", [as_tensor(x)])


def isfinite(x: Any) -> Tensor:
    return apply("isfinite", [as_tensor(x)])


def _axis_attr(axis: Any) -> Any:
    if axis is None or isinstance(axis, int):
        return axis
    return tuple(int(a) for a in axis)


def sum_(x: Any, axis: Any = None, dtype: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    t = as_tensor(x)
    if dtype is not None:
        t = cast(t, dtype)
    return apply("sum", [t], {"axis": _axis_attr(axis), "keepdim": bool(keepdim)})


def mean(x: Any, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    return apply("mean", [as_tensor(x)], {"axis": _axis_attr(axis), "keepdim": bool(keepdim)})


def max_(x: Any, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    return apply("max", [as_tensor(x)], {"axis": _axis_attr(axis), "keepdim": bool(keepdim)})


def min_(x: Any, axis: Any = None, keepdim: bool = False, name: str | None = None) -> Tensor:
    return apply("min", [as_tensor(x)], {"axis": _axis_attr(axis), "keepdim": bool(keepdim)})
