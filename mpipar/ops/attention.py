"""Fused attention (``scaled_dot_product_attention``), computed block by block as FlashAttention does.

Layout is Paddle's: query (B, S, H, D), key and value (B, Sk, Hkv, D) with ``H`` a multiple of
``Hkv`` (grouped-query attention: query head h reads key/value head ``h // (H / Hkv)``).

Forward walks the keys in blocks of ``block_size`` with an online softmax (a running row max
``m``, row sum ``l`` and output accumulator), so the (S, Sk) score matrix is never held: only
one (S, block) tile at a time. It returns the output and the rows' log-sum-exp ``lse``
(B, S, H), which is all backward keeps besides q, k, v and the output; backward recomputes each
tile's probabilities from ``lse`` (FlashAttention's recompute) instead of storing them.

Causal masking compares global positions: the query's and the key's positions are either
given (two int inputs, for sequences held in another order) or read off the shards' layouts
(their boxes, or the two chunks of a ``ZigzagShard``: load-balanced context parallelism). A key tile wholly in every query's
future is skipped, so a rank holding early queries does less work.

The kernels use only their local shards and global boxes: the rule
(``mpipar/spmd/rules/attention.py``) may split the batch, the query heads (key/value heads too
when they divide, else replicated and indexed by global head), or the query sequence (keys and
values gathered: context parallelism).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.comm import comm_context
from mpipar.distribute import reshard_to
from mpipar.mesh import ProcessMesh
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.placement import Partial, Replicate, Shard, like
from mpipar.spec import DistSpec, full_box
from mpipar.tape import GradContext

Array = Any


def _kv_of_query_heads(c: KernelContext) -> np.ndarray:
    """For each local query head, the local index of the key/value head it reads."""
    h_total, hk_total = c.in_shape(0)[2], c.in_shape(1)[2]
    if h_total % hk_total:
        raise ValueError(
            f"scaled_dot_product_attention: {h_total} query heads are not a multiple of {hk_total} key/value heads"
        )
    group = h_total // hk_total
    h0, h1 = c.in_boxes[0][2]
    g0, g1 = c.in_boxes[1][2]
    kv = np.arange(h0, h1) // group - g0
    if kv.size and (kv.min() < 0 or kv.max() >= g1 - g0):
        raise AssertionError(f"query heads [{h0}, {h1}) need key/value heads outside the local [{g0}, {g1})")
    return kv


def _positions(c: KernelContext, arrays: list[Array]) -> tuple[np.ndarray, np.ndarray]:
    """Global positions of the local queries and keys (given inputs, else the boxes' ranges)."""
    if arrays:
        qp, kp = arrays
        return np.asarray(qp if c.xp is np else qp.get()), np.asarray(kp if c.xp is np else kp.get())
    return c.positions(0, 1), c.positions(1, 1)


def _expand_kv(c: KernelContext, t: Array, kv: np.ndarray) -> Array:
    """(B, Sk, Hkv, D) -> (B, H, Sk, D) with each query head's key/value head."""
    if kv.size != t.shape[2] or (kv != np.arange(t.shape[2])).any():
        t = t[:, :, c.xp.asarray(kv), :]
    return t.transpose(0, 2, 1, 3)


def _scale(c: KernelContext, scale: float | None) -> float:
    return 1.0 / math.sqrt(c.in_shape(0)[3]) if scale is None else float(scale)


def _tiles(sk: int, block: int) -> list[tuple[int, int]]:
    return [(j, min(j + block, sk)) for j in range(0, sk, max(1, block))]


def _visible(qpos: np.ndarray, kpos: np.ndarray, causal: bool) -> np.ndarray | None:
    """(S, blk) bool of key visible to query, or None when every key is."""
    return (kpos[None, :] <= qpos[:, None]) if causal else None


@dataclass
class _Heads:
    """What both kernels start from: queries and each query head's keys and values as
    (B, H, S, D), the positions, the score scale, and the key tiles some query may see."""

    qt: Array
    kt: Array
    vt: Array
    kv: np.ndarray
    qpos: np.ndarray
    kpos: np.ndarray
    scale: Any
    tiles: list[tuple[int, int]]


def _heads(
    c: KernelContext,
    q: Array,
    k: Array,
    v: Array,
    positions: tuple[Array, ...],
    causal: bool,
    scale: float | None,
    block: int,
) -> _Heads:
    kv = _kv_of_query_heads(c)
    qpos, kpos = _positions(c, list(positions))
    kt, vt = _expand_kv(c, k, kv), _expand_kv(c, v, kv)  # (B, H, Sk, D)
    qmax = qpos.max() if qpos.size else -1
    # A tile wholly in every query's future contributes nothing: skipped (the causal saving).
    tiles = [(j0, j1) for j0, j1 in _tiles(kt.shape[2], block) if not (causal and kpos[j0:j1].min() > qmax)]
    return _Heads(q.transpose(0, 2, 1, 3), kt, vt, kv, qpos, kpos, q.dtype.type(_scale(c, scale)), tiles)


def _sdpa(
    c: KernelContext,
    q: Array,
    k: Array,
    v: Array,
    *positions: Array,
    is_causal: bool = True,
    scale: float | None = None,
    block_size: int = 128,
    **_: Any,
) -> tuple[Array, Array]:
    xp, dt = c.xp, q.dtype
    hd = _heads(c, q, k, v, positions, is_causal, scale, block_size)
    qt, kt, vt = hd.qt, hd.kt, hd.vt  # (B, H, S, D), (B, H, Sk, D)
    b, h, s, _ = qt.shape
    m = xp.full((b, h, s, 1), -np.inf, dtype=dt)  # running row max
    row_sum = xp.zeros((b, h, s, 1), dtype=dt)  # running row sum of exp
    acc = xp.zeros((b, h, s, vt.shape[-1]), dtype=dt)
    for j0, j1 in hd.tiles:
        scores = (qt @ kt[:, :, j0:j1, :].transpose(0, 1, 3, 2)) * hd.scale  # (B, H, S, blk): one tile only
        vis = _visible(hd.qpos, hd.kpos[j0:j1], is_causal)
        if vis is not None:
            scores = xp.where(xp.asarray(vis), scores, dt.type(-np.inf))
        m_new = xp.maximum(m, scores.max(axis=-1, keepdims=True))
        shift = xp.where(xp.isfinite(m_new), m_new, dt.type(0))  # rows with nothing visible yet
        p = xp.exp(scores - shift)
        alpha = xp.exp(m - shift)
        row_sum = row_sum * alpha + p.sum(axis=-1, keepdims=True)
        acc = acc * alpha + p @ vt[:, :, j0:j1, :]
        m = m_new
    seen = row_sum > 0
    out = xp.where(seen, acc / xp.where(seen, row_sum, dt.type(1)), dt.type(0))
    shift = xp.where(xp.isfinite(m), m, dt.type(0))
    lse = xp.where(seen, shift + xp.log(xp.where(seen, row_sum, dt.type(1))), dt.type(-np.inf))
    return out.transpose(0, 2, 1, 3), lse[..., 0].transpose(0, 2, 1)  # (B, S, H, D), (B, S, H)


def _sdpa_grad_kernel(
    c: KernelContext,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    dout: Array,
    *positions: Array,
    is_causal: bool = True,
    scale: float | None = None,
    block_size: int = 128,
    **_: Any,
) -> tuple[Array, Array, Array]:
    xp, dt = c.xp, q.dtype
    hd = _heads(c, q, k, v, positions, is_causal, scale, block_size)
    qt, kt, vt, kv, sc = hd.qt, hd.kt, hd.vt, hd.kv, hd.scale  # (B, H, S, D), (B, H, Sk, D)
    dot = dout.transpose(0, 2, 1, 3)  # (B, H, S, D)
    lse_t = lse.transpose(0, 2, 1)[..., None]  # (B, H, S, 1)
    lse_t = xp.where(xp.isfinite(lse_t), lse_t, dt.type(np.inf))  # a row that saw nothing: p = 0
    delta = (dout * out).sum(axis=-1).transpose(0, 2, 1)[..., None]  # (B, H, S, 1): rowsum(dO * O)
    dq = xp.zeros_like(qt)
    dk_h = xp.zeros_like(kt)  # per query head; summed into key/value heads below
    dv_h = xp.zeros_like(vt)
    for j0, j1 in hd.tiles:
        kb, vb = kt[:, :, j0:j1, :], vt[:, :, j0:j1, :]
        p = xp.exp((qt @ kb.transpose(0, 1, 3, 2)) * sc - lse_t)  # (B, H, S, blk), recomputed
        vis = _visible(hd.qpos, hd.kpos[j0:j1], is_causal)
        if vis is not None:
            p = xp.where(xp.asarray(vis), p, dt.type(0))
        dv_h[:, :, j0:j1, :] = p.transpose(0, 1, 3, 2) @ dot
        ds = p * (dot @ vb.transpose(0, 1, 3, 2) - delta)
        dq += (ds @ kb) * sc
        dk_h[:, :, j0:j1, :] = (ds.transpose(0, 1, 3, 2) @ qt) * sc
    # Query heads sharing a key/value head add their contributions to it.
    hk = k.shape[2]
    onehot = np.zeros((kv.size, hk), dtype=dt)
    onehot[np.arange(kv.size), kv] = 1
    oh = xp.asarray(onehot)
    dk = xp.einsum("bhsd,hg->bsgd", dk_h, oh)
    dv = xp.einsum("bhsd,hg->bsgd", dv_h, oh)
    return dq.transpose(0, 2, 1, 3), dk, dv


def _sdpa_attrs(ctx: GradContext) -> dict[str, Any]:
    return {
        "is_causal": ctx.attrs.get("is_causal", True),
        "scale": ctx.attrs.get("scale"),
        "block_size": ctx.attrs.get("block_size", 128),
    }


def _back_to_sequence_split(grad: Any, q_spec: DistSpec | None) -> Any:
    """A key/value gradient Partial over the axes that split the query sequence goes back to the
    sequence split at once (one reduce_scatter: the transpose of the forward's all_gather), as
    context-parallel training does, rather than leaving the reduction to its consumer (which
    may all-reduce it whole)."""
    if q_spec is None or not getattr(grad, "is_dist", False):
        return grad
    placements = list(grad.spec.placements)
    changed = False
    for axis, (pq, pg) in enumerate(zip(q_spec.placements, placements, strict=True)):
        if isinstance(pq, Shard) and pq.dim == 1 and isinstance(pg, Partial):
            placements[axis] = like(pq, 1)
            changed = True
    if not changed:
        return grad
    with comm_context("scaled_dot_product_attention backward: key/value gradients back to the sequence split"):
        return reshard_to(grad, grad.spec.with_placements(placements))


def _sdpa_grad(ctx: GradContext, g: list[Any]) -> list[Any]:
    q, k, v, *positions = ctx.inputs
    out, lse = ctx.outputs
    dq, dk, dv = apply("scaled_dot_product_attention_grad", [q, k, v, out, lse, g[0], *positions], _sdpa_attrs(ctx))
    q_spec = ctx.input_specs[0] if ctx.input_specs else None
    return [dq, _back_to_sequence_split(dk, q_spec), _back_to_sequence_split(dv, q_spec)] + [None] * len(positions)


def _samples(r: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    n = r.standard_normal
    perm = r.permutation(6).astype(np.int64)
    return [
        ([n((2, 5, 4, 3)), n((2, 5, 2, 3)), n((2, 5, 2, 3))], {"is_causal": True, "block_size": 2}),
        ([n((1, 4, 2, 3)), n((1, 6, 2, 3)), n((1, 6, 2, 3))], {"is_causal": False, "block_size": 4}),
        ([n((2, 6, 4, 2)), n((2, 6, 1, 2)), n((2, 6, 1, 2)), perm, perm], {"is_causal": True, "block_size": 2}),
    ]


def _grad_samples(r: np.random.Generator) -> list[tuple[list[Any], dict[str, Any]]]:
    out = []
    mesh = ProcessMesh([0], ["x"])
    for inputs, attrs in _samples(r)[::2]:
        q, k, v, *pos = inputs
        specs = [DistSpec(np.shape(a), mesh, [Replicate()]) for a in (q, k, v)]
        ctx = KernelContext(specs, [], [full_box(np.shape(a)) for a in (q, k, v)], [])
        o, lse = _sdpa(ctx, q, k, v, *pos, **attrs)  # a consistent (out, lse) pair for the grad op
        out.append(([q, k, v, o, lse, r.standard_normal(q.shape), *pos], attrs))
    return out


register_op(
    OpDef(
        "scaled_dot_product_attention",
        _sdpa,
        _sdpa_grad,
        num_outputs=2,
        save_inputs=None,
        save_outputs=(0, 1),
        nondiff_outputs=(1,),
        differentiable=(0, 1, 2),
        rule_attrs=(),
        dtype=lambda dt, a: [dt[0], dt[0]],
        sample=_samples,
    )
)
register_op(
    OpDef(
        "scaled_dot_product_attention_grad",
        _sdpa_grad_kernel,
        None,
        num_outputs=3,
        rule_attrs=(),
        dtype=lambda dt, a: [dt[0], dt[1], dt[2]],
        sample=_grad_samples,
    )
)
