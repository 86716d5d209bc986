"""Kernels and gradients of the neural-network ops (rules in ``mpipar/spmd/rules/nn.py``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpipar import random as mrandom
from mpipar._tape import GradContext
from mpipar._xp import extreme
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.spec import box_shape
from mpipar.spmd.rules.common import norm_axis

Array = Any


# ----------------------------------------------------------------------------- activations
def _relu_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    return [apply("relu_grad", [ctx.outputs[0], g[0]])]


register_op(
    OpDef(
        "relu",
        lambda c, x, **_: c.xp.maximum(x, x.dtype.type(0)),
        _relu_grad,
        save_inputs=(),
        save_outputs=(0,),
        sample=lambda r: [([r.standard_normal((5, 6))], {})],
    )
)
register_op(
    OpDef(
        "relu_grad",
        lambda c, y, g, **_: g * (y > 0),
        None,
        dtype=lambda dt, a: [dt[1]],
        sample=lambda r: [([r.standard_normal((5, 6)), r.standard_normal((5, 6))], {})],
    )
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _erf(x: Array) -> Array:
    try:
        from scipy.special import erf  # optional: exact and vectorised

        return erf(x)
    except ImportError:
        return np.vectorize(math.erf, otypes=[x.dtype])(x)


def _gelu(c: KernelContext, x: Array, approximate: bool = False, **_: Any) -> Array:
    t = x.dtype.type
    if approximate:
        return t(0.5) * x * (t(1) + np.tanh(t(_SQRT_2_OVER_PI) * (x + t(0.044715) * x * x * x)))
    return t(0.5) * x * (t(1) + _erf(x / t(math.sqrt(2.0))).astype(x.dtype, copy=False))


def _gelu_grad_kernel(c: KernelContext, x: Array, g: Array, approximate: bool = False, **_: Any) -> Array:
    t = x.dtype.type
    if approximate:
        inner = t(_SQRT_2_OVER_PI) * (x + t(0.044715) * x * x * x)  # not x**3: NumPy's pow is ~50x slower on negatives
        th = np.tanh(inner)
        d_inner = t(_SQRT_2_OVER_PI) * (t(1) + t(3 * 0.044715) * x * x)
        return g * (t(0.5) * (t(1) + th) + t(0.5) * x * (t(1) - th * th) * d_inner)
    cdf = t(0.5) * (t(1) + _erf(x / t(math.sqrt(2.0))).astype(x.dtype, copy=False))
    pdf = np.exp(-t(0.5) * x * x) / t(math.sqrt(2.0 * math.pi))
    return g * (cdf + x * pdf)


register_op(
    OpDef(
        "gelu",
        _gelu,
        lambda c, g: [apply("gelu_grad", [c.inputs[0], g[0]], {"approximate": c.attrs.get("approximate", False)})],
        rule_attrs=(),
        sample=lambda r: [
            ([r.standard_normal((5, 6))], {"approximate": True}),
            ([r.standard_normal((4,))], {"approximate": False}),
        ],
    )
)
register_op(
    OpDef(
        "gelu_grad",
        _gelu_grad_kernel,
        None,
        rule_attrs=(),
        sample=lambda r: [([r.standard_normal((5, 6)), r.standard_normal((5, 6))], {"approximate": True})],
    )
)


# ----------------------------------------------------------------------------- softmax
def _softmax(c: KernelContext, x: Array, axis: int = -1, **_: Any) -> Array:
    a = norm_axis(axis, x.ndim, "softmax")
    e = np.exp(x - extreme(x, "max", a, True, -np.inf))
    return e / np.sum(e, axis=a, keepdims=True)


def _log_softmax(c: KernelContext, x: Array, axis: int = -1, **_: Any) -> Array:
    a = norm_axis(axis, x.ndim, "log_softmax")
    shifted = x - extreme(x, "max", a, True, -np.inf)
    return shifted - np.log(np.sum(np.exp(shifted), axis=a, keepdims=True))


def _softmax_grad_kernel(c: KernelContext, y: Array, g: Array, axis: int = -1, **_: Any) -> Array:
    a = norm_axis(axis, y.ndim, "softmax_grad")
    return y * (g - np.sum(g * y, axis=a, keepdims=True))


def _log_softmax_grad_kernel(c: KernelContext, out: Array, g: Array, axis: int = -1, **_: Any) -> Array:
    a = norm_axis(axis, out.ndim, "log_softmax_grad")
    return g - np.exp(out) * np.sum(g, axis=a, keepdims=True)


_soft_samples = lambda r: [([r.standard_normal((4, 7))], {"axis": -1}), ([r.standard_normal((3, 5, 4))], {"axis": 1})]  # noqa: E731
_soft_grad_samples = lambda r: [([r.random((4, 7)), r.standard_normal((4, 7))], {"axis": -1})]  # noqa: E731
register_op(
    OpDef(
        "softmax",
        _softmax,
        lambda c, g: [apply("softmax_grad", [c.outputs[0], g[0]], {"axis": c.attrs.get("axis", -1)})],
        save_inputs=(),
        save_outputs=(0,),
        sample=_soft_samples,
    )
)
register_op(OpDef("softmax_grad", _softmax_grad_kernel, None, sample=_soft_grad_samples))
register_op(
    OpDef(
        "log_softmax",
        _log_softmax,
        lambda c, g: [apply("log_softmax_grad", [c.outputs[0], g[0]], {"axis": c.attrs.get("axis", -1)})],
        save_inputs=(),
        save_outputs=(0,),
        sample=_soft_samples,
    )
)
register_op(OpDef("log_softmax_grad", _log_softmax_grad_kernel, None, rule="softmax_grad", sample=_soft_grad_samples))


# ----------------------------------------------------------------------------- layer_norm
def norm_axes(x: Array, begin_norm_axis: int, op: str = "layer_norm") -> tuple[int, ...]:
    """The normalised (trailing) axes of ``x`` from ``begin_norm_axis``."""
    b = norm_axis(begin_norm_axis, x.ndim, op, "begin_norm_axis")
    return tuple(range(b, x.ndim))


def _layer_norm(
    c: KernelContext, x: Array, w: Array, b: Array, begin_norm_axis: int = -1, epsilon: float = 1e-5, **_: Any
) -> tuple[Array, Array, Array]:
    axes = norm_axes(x, begin_norm_axis)
    t = x.dtype.type
    mean = np.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    rstd = t(1) / np.sqrt(var + t(epsilon))
    y = centered * rstd * w + b
    batch = x.shape[: x.ndim - len(axes)]
    return y, mean.reshape(batch), rstd.reshape(batch)


def _layer_norm_grad_kernel(
    c: KernelContext, x: Array, w: Array, mean: Array, rstd: Array, dy: Array, begin_norm_axis: int = -1, **_: Any
) -> tuple[Array, Array, Array]:
    axes = norm_axes(x, begin_norm_axis)
    batch_axes = tuple(range(x.ndim - len(axes)))
    keep = mean.shape + (1,) * len(axes)
    xhat = (x - mean.reshape(keep)) * rstd.reshape(keep)
    dxhat = dy * w
    dx = rstd.reshape(keep) * (
        dxhat - np.mean(dxhat, axis=axes, keepdims=True) - xhat * np.mean(dxhat * xhat, axis=axes, keepdims=True)
    )
    dw = np.sum(dy * xhat, axis=batch_axes)
    db = np.sum(dy, axis=batch_axes)
    return dx, dw, db


def _layer_norm_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, w, _b = ctx.inputs
    _, mean, rstd = ctx.outputs
    dy = g[0]
    dx, dw, db = apply(
        "layer_norm_grad", [x, w, mean, rstd, dy], {"begin_norm_axis": ctx.attrs.get("begin_norm_axis", -1)}
    )
    return [dx, dw, db]


register_op(
    OpDef(
        "layer_norm",
        _layer_norm,
        _layer_norm_grad,
        num_outputs=3,
        save_inputs=(0, 1),
        save_outputs=(1, 2),
        nondiff_outputs=(1, 2),
        rule_attrs=("begin_norm_axis",),
        sample=lambda r: [
            (
                [r.standard_normal((4, 6)), r.standard_normal((6,)), r.standard_normal((6,))],
                {"begin_norm_axis": 1, "epsilon": 1e-5},
            ),
            (
                [r.standard_normal((2, 3, 5)), r.standard_normal((5,)), r.standard_normal((5,))],
                {"begin_norm_axis": 2, "epsilon": 1e-5},
            ),
        ],
    )
)
register_op(
    OpDef(
        "layer_norm_grad",
        _layer_norm_grad_kernel,
        None,
        num_outputs=3,
        rule_attrs=("begin_norm_axis",),
        dtype=lambda dt, a: [dt[4], dt[1], dt[1]],
        sample=lambda r: [
            (
                [
                    r.standard_normal((4, 6)),
                    r.standard_normal((6,)),
                    r.standard_normal((4,)),
                    r.random((4,)) + 0.5,
                    r.standard_normal((4, 6)),
                ],
                {"begin_norm_axis": 1},
            )
        ],
    )
)


# ----------------------------------------------------------------------------- embedding
def _embedding(c: KernelContext, ids: Array, table: Array, padding_idx: int | None = None, **_: Any) -> Array:
    (v0, v1), _h = c.in_boxes[1]
    if (v0, v1) == (0, c.in_shape(1)[0]):
        out = table[ids]
    else:  # this rank holds rows [v0, v1): look up those, zeros elsewhere (Partial(sum))
        local = ids - v0
        hit = (local >= 0) & (local < v1 - v0)
        out = table[np.where(hit, local, 0)] * hit[..., None].astype(table.dtype)
    if padding_idx is not None:
        out = out * (ids != padding_idx)[..., None].astype(table.dtype)
    return out


def _embedding_grad_kernel(
    c: KernelContext, ids: Array, dout: Array, num_embeddings: int = 0, padding_idx: int | None = None, **_: Any
) -> Array:
    (v0, v1), (h0, h1) = c.out_boxes[0]
    xp = c.xp  # the shards' module: CuPy's scatter-add needs a device output and device indices
    out = xp.zeros((v1 - v0, h1 - h0), dtype=dout.dtype)
    flat_ids = ids.reshape(-1) - v0
    flat_d = dout.reshape(flat_ids.shape[0], h1 - h0)  # (not -1: a shard with no columns has none to infer from)
    keep = (flat_ids >= 0) & (flat_ids < v1 - v0)
    if padding_idx is not None:
        keep &= flat_ids + v0 != padding_idx
    xp.add.at(out, flat_ids[keep], flat_d[keep])
    return out


def _embedding_backward(ctx: GradContext, g: list[Any]) -> list[Any]:
    ids = ctx.inputs[0]
    n = ctx.input_shapes[1][0]
    return [
        None,
        apply("embedding_grad", [ids, g[0]], {"num_embeddings": int(n), "padding_idx": ctx.attrs.get("padding_idx")}),
    ]


register_op(
    OpDef(
        "embedding",
        _embedding,
        _embedding_backward,
        save_inputs=(0,),
        differentiable=(1,),
        rule_attrs=(),
        dtype=lambda dt, a: [dt[1]],
        sample=lambda r: [
            ([r.integers(0, 9, (4, 5)), r.standard_normal((9, 6))], {}),
            ([r.integers(0, 7, (6,)), r.standard_normal((7, 4))], {"padding_idx": 2}),
        ],
    )
)
register_op(
    OpDef(
        "embedding_grad",
        _embedding_grad_kernel,
        None,
        rule_attrs=("num_embeddings",),
        dtype=lambda dt, a: [dt[1]],
        sample=lambda r: [([r.integers(0, 9, (4, 5)), r.standard_normal((4, 5, 6))], {"num_embeddings": 9})],
    )
)


# ----------------------------------------------------------------------------- cross entropy
def _ce(
    c: KernelContext, logits: Array, label: Array, axis: int = -1, ignore_index: int = -100, **_: Any
) -> tuple[Array, Array]:
    a = norm_axis(axis, logits.ndim, "cross_entropy")
    shifted = logits - extreme(logits, "max", a, True, -np.inf)
    sumexp = np.sum(np.exp(shifted), axis=a, keepdims=True)
    softmax = np.exp(shifted) / sumexp
    safe = np.where(label == ignore_index, 0, label).astype(np.int64)
    picked = np.take_along_axis(shifted, safe, axis=a)
    loss = np.log(sumexp) - picked
    loss = np.where(label == ignore_index, loss.dtype.type(0), loss)
    return softmax, loss


def _ce_grad_kernel(
    c: KernelContext, label: Array, softmax: Array, dloss: Array, axis: int = -1, ignore_index: int = -100, **_: Any
) -> Array:
    a = norm_axis(axis, softmax.ndim, "cross_entropy_grad")
    safe = np.where(label == ignore_index, 0, label).astype(np.int64)
    grad = softmax.copy()
    np.put_along_axis(grad, safe, np.take_along_axis(grad, safe, axis=a) - 1, axis=a)
    grad *= np.where(label == ignore_index, dloss.dtype.type(0), dloss)
    return grad


def _ce_backward(ctx: GradContext, g: list[Any]) -> list[Any]:
    label = ctx.inputs[1]
    softmax = ctx.outputs[0]
    dsoftmax, dloss = g
    axis = ctx.attrs.get("axis", -1)
    dlogits = None
    if dloss is not None:
        attrs = {"axis": axis, "ignore_index": ctx.attrs.get("ignore_index", -100)}
        dlogits = apply("cross_entropy_with_softmax_grad", [label, softmax, dloss], attrs)
    if dsoftmax is not None:  # the returned softmax was used too
        through = apply("softmax_grad", [softmax, dsoftmax], {"axis": axis})
        dlogits = through if dlogits is None else apply("add", [dlogits, through])
    return [dlogits, None]


def _ce_samples(rng: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    return [
        ([rng.standard_normal((6, 5)), rng.integers(0, 5, (6, 1))], {"axis": -1}),
        ([rng.standard_normal((2, 4, 7)), rng.integers(0, 7, (2, 4, 1))], {"axis": -1, "ignore_index": 3}),
    ]


register_op(
    OpDef(
        "cross_entropy_with_softmax",
        _ce,
        _ce_backward,
        num_outputs=2,
        save_inputs=(1,),
        save_outputs=(0,),
        differentiable=(0,),
        rule_attrs=("axis",),
        dtype=lambda dt, a: [dt[0], dt[0]],
        sample=_ce_samples,
    )
)
register_op(
    OpDef(
        "cross_entropy_with_softmax_grad",
        _ce_grad_kernel,
        None,
        rule_attrs=("axis",),
        dtype=lambda dt, a: [dt[1]],
        sample=lambda r: [([r.integers(0, 5, (6, 1)), r.random((6, 5)), r.standard_normal((6, 1))], {"axis": -1})],
    )
)


# ----------------------------------------------------------------------------- dropout
def _uniform(c: KernelContext, key: int) -> np.ndarray:
    """The input's elements' uniform draws, by global index (a zigzag box piece by piece)."""
    spec, box = c.in_specs[0], c.in_boxes[0]
    if not spec.zigzag:
        return mrandom.uniform_box(key, spec.shape, box)
    out = np.empty(box_shape(box))
    for index, gbox in spec.global_pieces(box):
        out[index] = mrandom.uniform_box(key, spec.shape, gbox)
    return out


def _dropout(c: KernelContext, x: Array, p: float = 0.5, key: int = 0, **_: Any) -> tuple[Array, Array]:
    # The mask is a function of (key, global index): identical on any mesh and in every mode.
    # It is kept (one byte an element) for backward, as Paddle and Megatron keep it.
    # Drawn on the host (mpipar.random), then moved to the shards' module: CuPy does not mix
    # host and device arrays in one expression.
    keep = c.xp.asarray(_uniform(c, key) >= p)
    return x * (keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - p))), keep


def _dropout_grad_kernel(c: KernelContext, keep: Array, g: Array, p: float = 0.5, **_: Any) -> Array:
    return g * (keep.astype(g.dtype) * g.dtype.type(1.0 / (1.0 - p)))


register_op(
    OpDef(
        "dropout",
        _dropout,
        lambda c, g: [apply("dropout_grad", [c.outputs[1], g[0]], {"p": c.attrs.get("p", 0.5)})],
        num_outputs=2,
        save_inputs=(),
        save_outputs=(1,),
        nondiff_outputs=(1,),
        rule_attrs=(),
        dtype=lambda dt, a: [dt[0], np.bool_],
        volatile_attrs=("key",),  # a new random key every call
        grad_attrs=("p",),  # (backward multiplies by the saved mask: the key is not read)
        sample=lambda r: [
            ([r.standard_normal((6, 8))], {"p": 0.3, "key": 12345}),
            ([r.standard_normal((3, 4, 5))], {"p": 0.5, "key": 7}),
        ],
    )
)
register_op(
    OpDef(
        "dropout_grad",
        _dropout_grad_kernel,
        None,
        rule_attrs=(),
        dtype=lambda dt, a: [dt[1]],
        sample=lambda r: [([r.random((6, 8)) > 0.3, r.standard_normal((6, 8))], {"p": 0.3})],
    )
)


# ----------------------------------------------------------------------------- accuracy
def _accuracy(c: KernelContext, pred: Array, label: Array, k: int = 1, **_: Any) -> Array:
    n_rows = math.prod(c.in_shape(0)[:-1])
    if pred.shape[-1] == 0 or pred.size == 0:
        return c.xp.zeros((), dtype=np.float64)
    kk = min(k, pred.shape[-1])
    top = np.argpartition(-pred, kk - 1, axis=-1)[..., :kk]
    correct = np.any(top == label, axis=-1)
    return c.xp.asarray(np.sum(correct) / n_rows, dtype=np.float64)


register_op(
    OpDef(
        "accuracy",
        _accuracy,
        None,
        rule_attrs=(),
        dtype=lambda dt, a: [np.float64],
        sample=lambda r: [
            ([r.standard_normal((8, 6)), r.integers(0, 6, (8, 1))], {"k": 1}),
            ([r.standard_normal((8, 6)), r.integers(0, 6, (8, 1))], {"k": 5}),
        ],
    )
)
