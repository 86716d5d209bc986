"""Rule of fused attention (``scaled_dot_product_attention``) and its gradient.

Query (B, S, H, D), key/value (B, Sk, Hkv, D), optional query/key positions (S,), (Sk,).
Per mesh axis the rule picks one split, from the query's placement there (else the key's):

| split | query, out, dout | key, value                         | dk, dv (grad)     | positions q / k |
|-------|------------------|------------------------------------|-------------------|-----------------|
| batch | S(0)             | S(0)                               | S(0)              | R / R           |
| heads | S(2)             | S(2) if H and Hkv divide by the    | S(2), or P(sum)   | R / R           |
|       |                  | heads split, else R (indexed by    | when replicated   |                 |
|       |                  | global head: tp > Hkv)             |                   |                 |
| seq   | S(1) or Z(1)     | R (all-gather: context parallel)   | P(sum) (reduce-   | S(0) / R        |
|       |                  |                                    | scatter after)    |                 |
| none  | R                | R                                  | R                 | R / R           |

A zigzag (load-balanced) query split stays zigzag in the query, output and log-sum-exp (the
kernel reads each query's global position off the layout). The head dim stays whole (the scores contract it inside the softmax), and no input stays
Partial (attention is not linear): a Partial or head-dim-split input is reduced or gathered.
The log-sum-exp (B, S, H) follows the query. Splitting the query sequence while the keys are
whole is exact because each query row's softmax sees every key; the kernel masks by global
position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard
from mpipar.spec import DistSpec
from mpipar.spmd.registry import Rule, SpecArg, SpmdResult, register_rule

_SPLIT_OF_DIM = {0: "batch", 1: "seq", 2: "heads"}


def _splits(q: DistSpec, k: DistSpec) -> list[str]:
    """The split chosen on each mesh axis (see the table); ``zigzag`` is the seq split load-balanced."""
    out = []
    for pq, pk in zip(q.placements, k.placements, strict=True):
        if isinstance(pq, ZigzagShard) and pq.dim == 1:
            out.append("zigzag")
        elif isinstance(pq, Shard) and pq.dim in _SPLIT_OF_DIM:
            out.append(_SPLIT_OF_DIM[pq.dim])
        elif isinstance(pk, Shard) and pk.dim in (0, 2):
            out.append(_SPLIT_OF_DIM[pk.dim])
        else:
            out.append("none")
    return out


def _check(op: str, specs: Sequence[DistSpec]) -> None:
    if len(specs) not in (3, 5):
        raise ValueError(f"{op}: expected query, key, value (and query/key positions), got {len(specs)} inputs")
    q, k, v = specs[:3]
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{op}: query, key and value must be 4-d (batch, seq, heads, head_dim), got {q}, {k}, {v}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{op}: query {q}, key {k} and value {v} disagree on batch, key length or head_dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: {q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")


class _AttentionRule(Rule):
    """Both directions of the forward op and of its gradient (``grad`` selects which)."""

    def __init__(self, grad: bool) -> None:
        self.grad = grad
        self.name = "scaled_dot_product_attention" + ("_grad" if grad else "")

    def _result(self, specs: Sequence[DistSpec], splits: list[str]) -> SpmdResult:
        q, k = specs[0], specs[1]
        mesh = q.mesh
        heads_ranks = math.prod(mesh.shape[a] for a, s in enumerate(splits) if s == "heads")
        kv_heads_split = q.shape[2] % heads_ranks == 0 and k.shape[2] % heads_ranks == 0
        q_pl: list[Placement] = []
        kv_pl: list[Placement] = []
        dkv_pl: list[Placement] = []
        qpos_pl: list[Placement] = []
        for s in splits:
            if s == "batch":
                q_pl.append(Shard(0))
                kv_pl.append(Shard(0))
                dkv_pl.append(Shard(0))
            elif s == "heads":
                q_pl.append(Shard(2))
                kv_pl.append(Shard(2) if kv_heads_split else Replicate())
                dkv_pl.append(Shard(2) if kv_heads_split else Partial("sum"))
            elif s in ("seq", "zigzag"):
                q_pl.append(ZigzagShard(1) if s == "zigzag" else Shard(1))
                kv_pl.append(Replicate())
                dkv_pl.append(Partial("sum"))
            else:
                q_pl.append(Replicate())
                kv_pl.append(Replicate())
                dkv_pl.append(Replicate())
            qpos_pl.append(Shard(0) if s == "seq" else ZigzagShard(0) if s == "zigzag" else Replicate())
        rep = [Replicate()] * mesh.ndim
        lse_pl = list(q_pl)  # (B, S, H): the query's dims 0-2
        qs = DistSpec(q.shape, mesh, q_pl)
        ks = DistSpec(k.shape, mesh, kv_pl)
        vs = DistSpec(specs[2].shape, mesh, kv_pl)
        lse = DistSpec(q.shape[:3], mesh, lse_pl)
        npos = 2 if len(specs) in (5, 8) else 0
        pos = [DistSpec(specs[-2].shape, mesh, qpos_pl), DistSpec(specs[-1].shape, mesh, rep)] if npos else []
        outs: tuple[DistSpec, ...]
        if self.grad:
            ins = [qs, ks, vs, qs, lse, qs, *pos]  # q, k, v, out, lse, dout, positions
            outs = (qs, DistSpec(k.shape, mesh, dkv_pl), DistSpec(specs[2].shape, mesh, dkv_pl))
        else:
            ins = [qs, ks, vs, *pos]
            outs = (qs, lse)
        reason = ", ".join(
            f"{name}: {s}" + (" (key/value heads replicated)" if s == "heads" and not kv_heads_split else "")
            for name, s in zip(mesh.dim_names, splits, strict=True)
        )
        return SpmdResult(tuple(ins), outs, self.name, reason)

    def infer_forward(self, inputs: Sequence[SpecArg], **attrs: Any) -> SpmdResult:
        specs = [s for s in inputs if isinstance(s, DistSpec)]
        if len(specs) != len(inputs):
            raise TypeError(f"{self.name}: inputs must be DistSpecs")
        _check(self.name, [*specs[:3], *specs[(6 if self.grad else 3) :]])
        return self._result(specs, _splits(specs[0], specs[1]))

    def infer_backward(self, inputs: Sequence[SpecArg], outputs: Sequence[DistSpec], **attrs: Any) -> SpmdResult:
        specs = [s for s in inputs if isinstance(s, DistSpec)]
        out = outputs[0]
        splits = [
            "zigzag"
            if isinstance(p, ZigzagShard) and p.dim == 1
            else _SPLIT_OF_DIM[p.dim]
            if isinstance(p, Shard) and p.dim in _SPLIT_OF_DIM
            else "none"
            for p in out.placements
        ]
        return self._result(specs, splits)


register_rule("scaled_dot_product_attention", _AttentionRule(grad=False))
register_rule("scaled_dot_product_attention_grad", _AttentionRule(grad=True))
