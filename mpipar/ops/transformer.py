"""Kernels and gradients of the Llama blocks' ops: RMSNorm, SiLU, SwiGLU and rotary embedding.

Op names are Paddle's (``rms_norm``, ``swiglu``, ``fused_rotary_position_embedding``); their
rules live in ``mpipar/spmd/rules/transformer.py``.

* ``rms_norm(x, w) -> (y, rstd)``: ``y = x * rstd * w`` with ``rstd = 1/sqrt(mean(x^2) + eps)``
  over the trailing dims from ``begin_norm_axis``; ``rstd`` is kept for backward (as LayerNorm
  keeps mean and rstd).
* ``silu(x) = x * sigmoid(x)``; ``swiglu(x, y) = silu(x) * y`` (the gate and the up projection
  of a SwiGLU MLP, fused so the gate's activation is never stored).
* ``fused_rotary_position_embedding(x, positions)``: rotary embedding of ``x`` (B, S, H, D)
  at the given global positions (S,), rotate-half ("neox") style as Hugging Face Llama uses:
  the pair (x[i], x[i + D/2]) is rotated by ``pos * theta^(-2i/D)``. The positions are an
  input, not an offset, so a sequence split along a mesh axis (context parallel, in any
  chunk order) rotates each token by its global position. It is a rotation: the gradient is
  the same op with the angle negated (``inverse``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpipar._tape import GradContext
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.ops.nn_ops import norm_axes

Array = Any


# ----------------------------------------------------------------------------- rms_norm
def _rms_norm(
    c: KernelContext, x: Array, w: Array, begin_norm_axis: int = -1, epsilon: float = 1e-6, **_: Any
) -> tuple[Array, Array]:
    axes = norm_axes(x, begin_norm_axis, "rms_norm")
    t = x.dtype.type
    rstd = t(1) / c.xp.sqrt(c.xp.mean(x * x, axis=axes, keepdims=True) + t(epsilon))
    return x * rstd * w, rstd.reshape(x.shape[: x.ndim - len(axes)])


def _rms_norm_grad_kernel(
    c: KernelContext, x: Array, w: Array, rstd: Array, dy: Array, begin_norm_axis: int = -1, **_: Any
) -> tuple[Array, Array]:
    axes = norm_axes(x, begin_norm_axis, "rms_norm")
    keep = rstd.shape + (1,) * len(axes)
    r = rstd.reshape(keep)
    xhat = x * r
    dxhat = dy * w
    dx = r * (dxhat - xhat * c.xp.mean(dxhat * xhat, axis=axes, keepdims=True))
    dw = c.xp.sum(dy * xhat, axis=tuple(range(x.ndim - len(axes))))
    return dx, dw


def _rms_norm_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, w = ctx.inputs
    rstd = ctx.outputs[1]
    dx, dw = apply("rms_norm_grad", [x, w, rstd, g[0]], {"begin_norm_axis": ctx.attrs.get("begin_norm_axis", -1)})
    return [dx, dw]


register_op(
    OpDef(
        "rms_norm",
        _rms_norm,
        _rms_norm_grad,
        num_outputs=2,
        save_inputs=(0, 1),
        save_outputs=(1,),
        nondiff_outputs=(1,),
        rule_attrs=("begin_norm_axis",),
        sample=lambda r: [
            ([r.standard_normal((4, 6)), r.standard_normal((6,))], {"begin_norm_axis": 1, "epsilon": 1e-6}),
            ([r.standard_normal((2, 5, 4)), r.standard_normal((4,))], {"begin_norm_axis": 2, "epsilon": 1e-5}),
        ],
    )
)
register_op(
    OpDef(
        "rms_norm_grad",
        _rms_norm_grad_kernel,
        None,
        num_outputs=2,
        rule_attrs=("begin_norm_axis",),
        dtype=lambda dt, a: [dt[3], dt[1]],
        sample=lambda r: [
            (
                [r.standard_normal((4, 6)), r.standard_normal((6,)), r.random((4,)) + 0.5, r.standard_normal((4, 6))],
                {"begin_norm_axis": 1},
            )
        ],
    )
)


# ----------------------------------------------------------------------------- silu / swiglu
def _sigmoid(x: Array) -> Array:
    one = x.dtype.type(1)
    return one / (one + np.exp(-x))


def _silu_grad_factor(x: Array) -> Array:
    """d silu / dx = sigmoid(x) * (1 + x * (1 - sigmoid(x)))."""
    s = _sigmoid(x)
    one = x.dtype.type(1)
    return s * (one + x * (one - s))


register_op(
    OpDef(
        "silu",
        lambda c, x, **_: x * _sigmoid(x),
        lambda c, g: [apply("silu_grad", [c.inputs[0], g[0]])],
        rule_attrs=(),
        sample=lambda r: [([r.standard_normal((5, 6))], {}), ([r.standard_normal((2, 3, 4))], {})],
    )
)
register_op(
    OpDef(
        "silu_grad",
        lambda c, x, g, **_: g * _silu_grad_factor(x),
        None,
        rule_attrs=(),
        sample=lambda r: [([r.standard_normal((5, 6)), r.standard_normal((5, 6))], {})],
    )
)


def _swiglu_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    x, y = ctx.inputs
    dx, dy = apply("swiglu_grad", [x, y, g[0]])
    return [dx, dy]


register_op(
    OpDef(
        "swiglu",
        lambda c, x, y, **_: x * _sigmoid(x) * y,
        _swiglu_grad,
        rule_attrs=(),
        sample=lambda r: [
            ([r.standard_normal((4, 6)), r.standard_normal((4, 6))], {}),
            ([r.standard_normal((2, 3, 5)), r.standard_normal((2, 3, 5))], {}),
        ],
    )
)
register_op(
    OpDef(
        "swiglu_grad",
        lambda c, x, y, g, **_: (g * y * _silu_grad_factor(x), g * x * _sigmoid(x)),
        None,
        num_outputs=2,
        rule_attrs=(),
        dtype=lambda dt, a: [dt[2], dt[2]],
        sample=lambda r: [([r.standard_normal((4, 6)), r.standard_normal((4, 6)), r.standard_normal((4, 6))], {})],
    )
)


# ----------------------------------------------------------------------------- rotary embedding
def rope_angles(positions: Array, head_dim: int, theta: float, dtype: Any) -> tuple[Array, Array]:
    """cos and sin (S, D/2) of each position's rotation per frequency, in float64 then cast, so
    every layout computes the same angles for the same global position."""
    if head_dim % 2:
        raise ValueError(f"fused_rotary_position_embedding: head_dim must be even, got {head_dim}")
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (D/2,)
    angle = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (S, D/2)
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rope(
    c: KernelContext, x: Array, positions: Array, theta: float = 10000.0, inverse: bool = False, **_: Any
) -> Array:
    d = x.shape[-1]
    cos, sin = rope_angles(np.asarray(positions if c.xp is np else positions.get()), d, theta, x.dtype)
    cos, sin = c.xp.asarray(cos)[None, :, None, :], c.xp.asarray(sin)[None, :, None, :]  # (1, S, 1, D/2)
    if inverse:
        sin = -sin
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return c.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    attrs = {"theta": ctx.attrs.get("theta", 10000.0), "inverse": not ctx.attrs.get("inverse", False)}
    return [apply("fused_rotary_position_embedding", [g[0], ctx.inputs[1]], attrs), None]


register_op(
    OpDef(
        "fused_rotary_position_embedding",
        _rope,
        _rope_grad,
        save_inputs=(1,),
        differentiable=(0,),
        rule_attrs=(),
        dtype=lambda dt, a: [dt[0]],
        sample=lambda r: [
            ([r.standard_normal((2, 5, 3, 4)), np.arange(5, dtype=np.int64)], {"theta": 10000.0}),
            ([r.standard_normal((1, 6, 2, 6)), r.permutation(6).astype(np.int64)], {"theta": 500000.0}),
            ([r.standard_normal((2, 4, 2, 2)), np.arange(4, dtype=np.int64)], {"theta": 100.0, "inverse": True}),
        ],
    )
)
