"""Layout ops: reshape, transpose, unsqueeze, squeeze, expand, split, concat, slice, indexing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar._tape import GradContext
from mpipar.ops.creation import as_tensor, zeros_like_global
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.spmd.rules.common import norm_axis
from mpipar.spmd.rules.manipulation import resolve_shape, slice_bounds, split_sections
from mpipar.tensor import Tensor

Array = Any


def _t(x: Any) -> Tensor:
    return as_tensor(x)


def reduce_to_shape(g: Tensor | None, shape: Sequence[int]) -> Tensor | None:
    """Sum a broadcast gradient back to ``shape`` (the inverse of NumPy broadcasting).

    Here, below ``math.py``, because ``expand``'s gradient is this sum and ``sum``'s gradient is
    an ``expand``: the sum is called by its registered name, so neither module imports the other's.
    """
    if g is None:
        return None
    shape = tuple(shape)
    if tuple(g._shape) == shape:  # (plain tuples: ``Shape``'s own ``==`` is Python code)
        return g
    lead = g.ndim - len(shape)
    kept = [lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1]
    if lead and not kept:  # only leading dims to drop (a bias): one sum, no reshape after it
        return apply("sum", [g], {"axis": tuple(range(lead)), "keepdim": False})
    axes = list(range(lead)) + kept
    out = apply("sum", [g], {"axis": tuple(int(a) for a in axes), "keepdim": True}) if axes else g
    return reshape(out, list(shape)) if tuple(out.shape) != shape else out


# ----------------------------------------------------------------------------- reshape-like
def _to_local_shape(ctx: KernelContext, x: Array, **_: Any) -> Array:
    return x.reshape(ctx.out_local_shape(0))


def _back_to_input_shape(ctx: GradContext, g: list[Any]) -> list[Any]:
    return [reshape(g[0], list(ctx.input_shapes[0]))]


register_op(
    OpDef(
        "reshape",
        _to_local_shape,
        _back_to_input_shape,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((4, 6))], {"shape": [24]}),
            ([r.standard_normal((4, 6))], {"shape": [2, 2, 6]}),
            ([r.standard_normal((2, 3, 4))], {"shape": [6, -1]}),
            ([r.standard_normal((5, 6))], {"shape": [30]}),
            ([r.standard_normal((6, 4))], {"shape": [3, 8]}),
            ([r.standard_normal((4, 1, 6))], {"shape": [4, 6]}),
        ],
    )
)
register_op(
    OpDef(
        "unsqueeze",
        _to_local_shape,
        _back_to_input_shape,
        save_inputs=(),
        sample=lambda r: [([r.standard_normal((4, 6))], {"axis": 1}), ([r.standard_normal((5,))], {"axis": [0, 2]})],
    )
)
register_op(
    OpDef(
        "squeeze",
        _to_local_shape,
        _back_to_input_shape,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((4, 1, 6))], {"axis": 1}),
            ([r.standard_normal((1, 5, 1))], {"axis": None}),
        ],
    )
)


def _transpose_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    perm = [int(p) % len(ctx.input_shapes[0]) for p in ctx.attrs["perm"]]
    inverse = list(np.argsort(perm))
    return [transpose(g[0], inverse)]


register_op(
    OpDef(
        "transpose",
        lambda c, x, perm=(), **_: x.transpose(tuple(int(p) % x.ndim for p in perm)),
        _transpose_grad,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((4, 6))], {"perm": [1, 0]}),
            ([r.standard_normal((2, 3, 5))], {"perm": [2, 0, 1]}),
        ],
    )
)


def _expand_kernel(ctx: KernelContext, x: Array, shape: Sequence[int] = (), **_: Any) -> Array:
    out_shape = ctx.out_local_shape(0)
    if type(x) is np.ndarray and x.ndim == 0:
        # A 0-d value (a loss's gradient) broadcast to the input's shape: the read-only view
        # ``np.broadcast_to`` makes (every stride 0 over x's one element), made by the array
        # constructor alone, without broadcast_to's Python layers.
        view = np.ndarray(out_shape, x.dtype, x, 0, (0,) * len(out_shape))
        # (a view of a writeable x would be writeable; positional: ``executor.freeze``)
        view.setflags(False)  # type: ignore[call-arg]
        return view
    return ctx.xp.broadcast_to(x, out_shape)


def _expand_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    return [reduce_to_shape(g[0], ctx.input_shapes[0])]


register_op(
    OpDef(
        "expand",
        _expand_kernel,
        _expand_grad,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((4, 1))], {"shape": [4, 6]}),
            ([r.standard_normal((6,))], {"shape": [3, 6]}),
            ([r.standard_normal((1, 5))], {"shape": [2, 4, 5]}),
        ],
    )
)


# ----------------------------------------------------------------------------- split / concat
def _split_kernel(ctx: KernelContext, x: Array, num_or_sections: Any = 2, axis: int = 0, **_: Any) -> tuple[Array, ...]:
    a = norm_axis(axis, x.ndim, "split")
    secs = split_sections(x.shape[a], num_or_sections, "split")
    cuts = np.cumsum(secs)[:-1].tolist()
    return tuple(ctx.xp.split(x, cuts, axis=a))


def _split_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    shape = ctx.input_shapes[0]
    a = norm_axis(ctx.attrs.get("axis", 0), len(shape), "split")
    secs = split_sections(shape[a], ctx.attrs.get("num_or_sections", 2), "split")
    like = next(x for x in g if x is not None)
    parts = []
    for gi, n in zip(g, secs, strict=True):
        if gi is None:
            piece_shape = list(shape)
            piece_shape[a] = n
            gi = zeros_like_global(like, piece_shape)
        parts.append(gi)
    return [concat(parts, axis=a)]


def _concat_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    a = norm_axis(ctx.attrs.get("axis", 0), len(ctx.input_shapes[0]), "concat")
    sizes = [s[a] for s in ctx.input_shapes]
    return list(split(g[0], sizes, axis=a)) if len(sizes) > 1 else [g[0]]


register_op(
    OpDef(
        "concat",
        lambda c, *xs, axis=0, **_: c.xp.concatenate(xs, axis=norm_axis(axis, xs[0].ndim, "concat")),
        _concat_grad,
        save_inputs=(),
        list_input=True,
        sample=lambda r: [
            ([[r.standard_normal((3, 4)), r.standard_normal((2, 4))]], {"axis": 0}),
            ([[r.standard_normal((5, 2)), r.standard_normal((5, 3)), r.standard_normal((5, 1))]], {"axis": 1}),
        ],
    )
)


# ----------------------------------------------------------------------------- slice
def _slice_kernel(
    ctx: KernelContext,
    x: Array,
    axes: Sequence[int] = (),
    starts: Sequence[int] = (),
    ends: Sequence[int] = (),
    **_: Any,
) -> Array:
    index = [slice(None)] * x.ndim
    # Sliced dims are whole on every rank (the rule keeps them unsplit), so global bounds apply.
    for a, (s, e) in slice_bounds(ctx.in_shape(0), axes, starts, ends).items():
        index[a] = slice(s, e)
    return x[tuple(index)]


def _slice_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    attrs = {k: ctx.attrs[k] for k in ("axes", "starts", "ends")}
    return [apply("slice_grad", [g[0]], {"input_shape": tuple(ctx.input_shapes[0]), **attrs})]


def _slice_grad_kernel(
    ctx: KernelContext,
    g: Array,
    input_shape: Sequence[int] = (),
    axes: Sequence[int] = (),
    starts: Sequence[int] = (),
    ends: Sequence[int] = (),
    **_: Any,
) -> Array:
    out = ctx.xp.zeros(ctx.out_local_shape(0), dtype=g.dtype)
    index = [slice(None)] * g.ndim
    for a, (s, e) in slice_bounds(input_shape, axes, starts, ends).items():
        index[a] = slice(s, e)
    out[tuple(index)] = g
    return out


register_op(
    OpDef(
        "slice",
        _slice_kernel,
        _slice_grad,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((6, 5))], {"axes": [0], "starts": [1], "ends": [4]}),
            ([r.standard_normal((4, 6, 3))], {"axes": [1, 2], "starts": [0, -2], "ends": [6, 3]}),
        ],
    )
)
register_op(
    OpDef(
        "slice_grad",
        _slice_grad_kernel,
        None,
        differentiable=(),
        sample=lambda r: [
            ([r.standard_normal((3, 5))], {"input_shape": (6, 5), "axes": [0], "starts": [1], "ends": [4]})
        ],
    )
)


# ----------------------------------------------------------------------------- eager API
def reshape(x: Any, shape: Sequence[int], name: str | None = None) -> Tensor:
    t = _t(x)
    target = resolve_shape(t.shape, [int(n) for n in shape])
    if tuple(target) == tuple(t.shape):
        return t
    return apply("reshape", [t], {"shape": tuple(target)})


def transpose(x: Any, perm: Sequence[int], name: str | None = None) -> Tensor:
    return apply("transpose", [_t(x)], {"perm": tuple(int(p) for p in perm)})


def unsqueeze(x: Any, axis: int | Sequence[int], name: str | None = None) -> Tensor:
    ax = int(axis) if isinstance(axis, (int, np.integer)) else tuple(int(a) for a in axis)
    return apply("unsqueeze", [_t(x)], {"axis": ax})


def squeeze(x: Any, axis: int | Sequence[int] | None = None, name: str | None = None) -> Tensor:
    ax = None if axis is None else int(axis) if isinstance(axis, (int, np.integer)) else tuple(int(a) for a in axis)
    return apply("squeeze", [_t(x)], {"axis": ax})


def expand(x: Any, shape: Sequence[int], name: str | None = None) -> Tensor:
    t = _t(x)
    if tuple(shape) == tuple(t.shape):
        return t
    return apply("expand", [t], {"shape": tuple(int(n) for n in shape)})


broadcast_to = expand


def split(x: Any, num_or_sections: int | Sequence[int], axis: int = 0, name: str | None = None) -> list[Tensor]:
    t = _t(x)
    n = num_or_sections if isinstance(num_or_sections, int) else tuple(int(s) for s in num_or_sections)
    out = apply("split", [t], {"num_or_sections": n, "axis": int(axis)})
    return list(out) if isinstance(out, tuple) else [out]


def concat(x: Sequence[Any], axis: int = 0, name: str | None = None) -> Tensor:
    xs = [_t(v) for v in x]
    if not xs:
        raise ValueError("concat needs at least one tensor")
    if len(xs) == 1:
        return xs[0]
    return apply("concat", [xs], {"axis": int(axis)})


def slice_(x: Any, axes: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> Tensor:
    return apply(
        "slice",
        [_t(x)],
        {
            "axes": tuple(int(a) for a in axes),
            "starts": tuple(int(s) for s in starts),
            "ends": tuple(int(e) for e in ends),
        },
    )


def getitem(x: Tensor, index: Any) -> Tensor:
    """Basic indexing: ints and step-1 slices (``x[0]``, ``x[:, 1:3]``, ``x[..., -1]``)."""
    if not isinstance(index, tuple):
        index = (index,)
    if Ellipsis in index:
        i = index.index(Ellipsis)
        fill = x.ndim - (len(index) - 1)
        index = index[:i] + (slice(None),) * fill + index[i + 1 :]
    if len(index) > x.ndim:
        raise IndexError(f"too many indices ({len(index)}) for a tensor of {x.ndim} dims")
    axes, starts, ends, drop = [], [], [], []
    for d, item in enumerate(index):
        n = x.shape[d]
        if isinstance(item, (int, np.integer)):
            i = int(item) + (n if item < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {item} is out of range for dim {d} of size {n}")
            axes.append(d)
            starts.append(i)
            ends.append(i + 1)
            drop.append(d)
        elif isinstance(item, slice):
            s, e, step = item.indices(n)
            if step != 1:
                raise IndexError(f"slicing with step {step} is not supported (dim {d})")
            if (s, e) != (0, n):
                axes.append(d)
                starts.append(s)
                ends.append(max(s, e))
        else:
            raise IndexError(f"unsupported index {item!r}: use ints and step-1 slices")
    out = slice_(x, axes, starts, ends) if axes else x
    return squeeze(out, drop) if drop else out


def _num_sections(attrs: dict[str, Any]) -> int:
    n = attrs.get("num_or_sections", 2)
    return n if isinstance(n, int) else len(n)


register_op(
    OpDef(
        "split",
        _split_kernel,
        _split_grad,
        num_outputs=_num_sections,
        save_inputs=(),
        sample=lambda r: [
            ([r.standard_normal((6, 4))], {"num_or_sections": 2, "axis": 0}),
            ([r.standard_normal((3, 7))], {"num_or_sections": [2, 4, 1], "axis": 1}),
        ],
    )
)
