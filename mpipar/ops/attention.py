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

from mpipar._modes import Mode, execution_mode
from mpipar._tape import GradContext, Node, is_grad_enabled, no_grad, pack_saved
from mpipar.backend import current_backend
from mpipar.comm import comm_context
from mpipar.distribute import dtensor_from_local, reshard_to
from mpipar.mesh import ProcessMesh
from mpipar.ops.dispatch import KernelContext, OpDef, apply, register_op
from mpipar.placement import Partial, Replicate, Shard, like
from mpipar.spec import DistSpec, full_box
from mpipar.spmd import infer_forward as spmd_infer_forward
from mpipar.tensor import Tensor, reuse_reshards

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


def key_tiles(
    sk: int, block: int, qpos: np.ndarray | None = None, kpos: np.ndarray | None = None
) -> list[tuple[int, int]]:
    """The key tiles ``[j0, j1)`` of ``block`` keys the kernels run over ``sk`` keys; with the
    local queries' and keys' global positions (a causal mask), less those wholly in every
    query's future, which contribute nothing (the causal saving). The cost model
    (``simulator.op_cost``) counts the same tiles."""
    tiles = [(j, min(j + block, sk)) for j in range(0, sk, max(1, block))]
    if qpos is None or kpos is None:
        return tiles
    qmax = qpos.max() if qpos.size else -1
    return [(j0, j1) for j0, j1 in tiles if not kpos[j0:j1].min() > qmax]


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
    tiles = key_tiles(kt.shape[2], block, qpos if causal else None, kpos if causal else None)
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
        cost_attrs=("is_causal", "block_size"),
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
        cost_attrs=("is_causal", "block_size"),
    )
)


# ------------------------------------------------------------------------------ ring attention
CP_COMM = ("allgather", "ring")
"""How fused attention gets the other context-parallel ranks' keys and values: ``allgather``
(the rule gathers them before the kernel, as Llama 3 trained) or ``ring`` (blocks passed
around the ring of the axis, one point-to-point exchange per step, as Ring Attention does)."""


def ring_axis(q: Tensor) -> int | None:
    """The one mesh axis of more than one rank that splits the query sequence (dim 1), or None."""
    if not q.is_dist:
        return None
    spec = q.spec
    axes = [a for a in spec.shard_axes(1) if spec.mesh.shape[a] > 1]
    return axes[0] if len(axes) == 1 else None


def _rolled(spec: DistSpec, axis: int, step: int) -> DistSpec:
    """``spec`` with the ranks of ``axis`` rolled ``step`` places: the process at coordinate c
    holds what coordinate c - step holds in ``spec`` (each step one send to the next rank)."""
    ids = np.roll(np.asarray(spec.mesh.mesh), -step, axis=axis)
    return spec.with_mesh(ProcessMesh(ids, dim_names=spec.mesh.dim_names))


def _ring_layouts(q: Tensor, k: Tensor, v: Tensor, axis: int) -> tuple[DistSpec, DistSpec, DistSpec, DistSpec]:
    """The layouts of q, k, v and of the key/value gradients: the rule's (batch, heads) on every
    axis, and on the ring axis keys and values split as the query is, not gathered."""
    res = spmd_infer_forward("scaled_dot_product_attention", [q.spec, k.spec, v.spec])
    qs, ks, vs = res.inputs[:3]
    dkv = spmd_infer_forward("scaled_dot_product_attention_grad", [qs, ks, vs, qs, res.outputs[1], qs]).outputs[1]
    split = qs.placements[axis]

    def on_ring(s: DistSpec) -> DistSpec:
        pls = list(s.placements)
        pls[axis] = split
        return s.with_placements(pls)

    return qs, on_ring(ks), on_ring(vs), on_ring(dkv)


def _context(qs: DistSpec, ks: DistSpec, rank: int, held: DistSpec) -> KernelContext:
    """The kernel context of ``rank`` holding the key block ``held`` gives it (heads, boxes)."""
    return KernelContext([qs, held, held], [], [qs.boxes[rank], held.boxes[rank], held.boxes[rank]], [])


def _merge(xp: Any, out: Array, lse: Array, o: Array, l: Array) -> tuple[Array, Array]:  # noqa: E741
    """Two partial attentions over disjoint key sets, merged by their log-sum-exps."""
    new = xp.logaddexp(lse, l)
    shift = xp.where(xp.isfinite(new), new, 0)
    w_old = xp.where(xp.isfinite(lse), xp.exp(lse - shift), 0)[..., None]
    w_new = xp.where(xp.isfinite(l), xp.exp(l - shift), 0)[..., None]
    return out * w_old + o * w_new, new


def _send_on(t: Tensor, base: DistSpec, axis: int, step: int) -> Tensor:
    """Pass ``t`` (laid out as ``base`` rolled ``step`` places) one rank further around the ring.
    Never a reused reshard: a rank keeps one block at a time (the ring's memory saving), and
    backward passes the blocks again."""
    with (
        comm_context(f"ring attention: blocks one rank on along {base.mesh.dim_names[axis]!r}"),
        reuse_reshards(False),
    ):
        return reshard_to(t, _rolled(base, axis, step + 1))


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, axis: int, attrs: dict[str, Any]) -> tuple[Tensor, Tensor]:
    backend = current_backend()
    qs, ks = q.spec, k.spec
    lse_spec = DistSpec(qs.shape[:3], qs.mesh, qs.placements)
    abstract = execution_mode([q, k, v], backend) is Mode.ABSTRACT
    ranks = backend.hosted_ranks(qs.mesh)
    xp = backend.xp
    outs: dict[int, Array] = {}
    lses: dict[int, Array] = {}
    kb, vb = k, v
    n = qs.mesh.shape[axis]
    for step in range(n):
        held = _rolled(ks, axis, step)
        if not abstract:
            for r in ranks:
                c = _context(qs, ks, r, held)
                qpos, kpos = qs.positions(qs.boxes[r], 1), held.positions(held.boxes[r], 1)
                o, lse = _sdpa(
                    c,
                    q.local_tensor(r),
                    kb.local_tensor(r),
                    vb.local_tensor(r),
                    xp.asarray(qpos),
                    xp.asarray(kpos),
                    **attrs,
                )
                outs[r], lses[r] = (o, lse) if step == 0 else _merge(xp, outs[r], lses[r], o, lse)
        if step + 1 < n:
            kb, vb = _send_on(kb, ks, axis, step), _send_on(vb, ks, axis, step)
    if abstract:
        return Tensor.abstract(qs.shape, q.dtype, qs), Tensor.abstract(lse_spec.shape, q.dtype, lse_spec)
    out = dtensor_from_local(
        {r: outs[r].astype(q.dtype) for r in ranks}, qs.mesh, list(qs.placements), qs.shape, q.dtype
    )
    lse_t = dtensor_from_local({r: lses[r] for r in ranks}, qs.mesh, list(qs.placements), lse_spec.shape, q.dtype)
    return out, lse_t


def _ring_backward(ctx: GradContext, g: list[Any]) -> list[Any]:
    q, k, v = ctx.inputs
    out, lse = ctx.outputs
    axis, dkv_spec = ctx.attrs["axis"], ctx.attrs["dkv_spec"]
    attrs = _sdpa_attrs(ctx)
    assert q is not None and k is not None and v is not None and out is not None and lse is not None
    qs, ks = q.spec, k.spec
    dout = reshard_to(g[0], qs)
    backend = current_backend()
    abstract = execution_mode([q, k, v, dout], backend) is Mode.ABSTRACT
    ranks = backend.hosted_ranks(qs.mesh)
    xp = backend.xp
    dq: dict[int, Array] = {}
    kb, vb = k, v
    dk_t: Tensor | None = None
    dv_t: Tensor | None = None
    n = qs.mesh.shape[axis]
    for step in range(n):
        held = _rolled(ks, axis, step)
        held_grad = _rolled(dkv_spec, axis, step)
        dk_l: dict[int, Array] = {}
        dv_l: dict[int, Array] = {}
        if not abstract:
            for r in ranks:
                c = _context(qs, ks, r, held)
                qpos, kpos = qs.positions(qs.boxes[r], 1), held.positions(held.boxes[r], 1)
                a, b, e = _sdpa_grad_kernel(
                    c,
                    q.local_tensor(r),
                    kb.local_tensor(r),
                    vb.local_tensor(r),
                    out.local_tensor(r),
                    lse.local_tensor(r),
                    dout.local_tensor(r),
                    xp.asarray(qpos),
                    xp.asarray(kpos),
                    **attrs,
                )
                dq[r] = a if step == 0 else dq[r] + a
                dk_l[r] = b if dk_t is None else dk_t.local_tensor(r) + b
                dv_l[r] = e if dv_t is None else dv_t.local_tensor(r) + e
            hm = held_grad.mesh
            dk_t = dtensor_from_local(dk_l, hm, list(held_grad.placements), held_grad.shape, k.dtype)
            dv_t = dtensor_from_local(dv_l, hm, list(held_grad.placements), held_grad.shape, v.dtype)
        else:
            dk_t = Tensor.abstract(held_grad.shape, k.dtype, held_grad)
            dv_t = Tensor.abstract(held_grad.shape, v.dtype, held_grad)
        # The gradients travel with their blocks, one rank further each step and home at the end.
        dk_t, dv_t = _send_on(dk_t, dkv_spec, axis, step), _send_on(dv_t, dkv_spec, axis, step)
        if step + 1 < n:
            kb, vb = _send_on(kb, ks, axis, step), _send_on(vb, ks, axis, step)
    assert dk_t is not None and dv_t is not None
    home = dkv_spec
    dk_out, dv_out = reshard_to(dk_t, home), reshard_to(dv_t, home)  # the mesh as the inputs name it
    dq_t = (
        Tensor.abstract(qs.shape, q.dtype, qs)
        if abstract
        else dtensor_from_local({r: dq[r] for r in ranks}, qs.mesh, list(qs.placements), qs.shape, q.dtype)
    )
    return [dq_t, dk_out, dv_out]


def ring_attention(q: Tensor, k: Tensor, v: Tensor, attrs: dict[str, Any]) -> Tensor:
    """Fused attention with the query sequence split on one mesh axis and the keys and values
    passed around that axis's ring instead of gathered: each rank attends to the key block it
    holds, merges the partial results by their log-sum-exps (the kernel's online softmax, one
    block per ring step) and sends the block on; backward passes each block's key/value
    gradients around with it, home after the last step. Same result as the all-gather (to
    rounding); ``cp - 1`` sends of keys and of values forward, ``cp - 1`` of each and ``cp`` of
    each gradient backward."""
    axis = ring_axis(q)
    assert axis is not None
    qs, ks, vs, dkv = _ring_layouts(q, k, v, axis)
    with comm_context("ring attention input"):
        q, k, v = reshard_to(q, qs), reshard_to(k, ks), reshard_to(v, vs)
    with no_grad():
        out, lse = _ring_forward(q, k, v, axis, attrs)
    needs = [not t.stop_gradient for t in (q, k, v)]
    if is_grad_enabled() and any(needs):
        ctx = GradContext(
            "ring_attention",
            {**attrs, "axis": axis, "dkv_spec": dkv},
            [pack_saved(q), pack_saved(k), pack_saved(v)],
            [pack_saved(out), pack_saved(lse)],
            [tuple(t.shape) for t in (q, k, v)],
            [t.dtype for t in (q, k, v)],
            needs,
            [qs, ks, vs],
        )
        node = Node(
            "ring_attention",
            _ring_backward,
            ctx,
            [t if need else None for t, need in zip((q, k, v), needs, strict=True)],
            1,
        )
        out._set_history(node, 0)
        out.stop_gradient = False
    return out
