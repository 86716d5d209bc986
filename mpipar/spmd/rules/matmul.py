"""The matmul rule: ``...mk,...kn->...mn`` with transposes, 1-d operands and batch broadcasting.

Splitting m or n shards the output; splitting k (the contraction) makes the output
Partial(sum) -- Megatron's row-parallel linear. A Partial operand may meet only a replicated one.
"""

from __future__ import annotations

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import EinsumSpec
from mpipar.spmd.registry import register_rule
from mpipar.spmd.rules.common import UPPER


@register_rule("matmul")
def matmul_rule(specs: list[DistSpec], trans_x: bool = False, trans_y: bool = False, **_: object) -> EinsumSpec:
    if len(specs) != 2:
        raise ValueError(f"matmul takes 2 inputs, got {len(specs)}")
    x, y = specs
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError(f"matmul needs inputs with at least one dim, got x {x} and y {y}")
    xm = "k" if x.ndim == 1 else ("km" if trans_x else "mk")
    yn = "k" if y.ndim == 1 else ("nk" if trans_y else "kn")
    xb, yb = x.shape[: x.ndim - len(xm)], y.shape[: y.ndim - len(yn)]
    nb = max(len(xb), len(yb))
    batch = "abcdefghij"[:nb]
    fresh = iter(UPPER)
    no_shard: set[str] = set()

    def batch_letters(shape: tuple[int, ...], other: tuple[int, ...]) -> str:
        out = []
        for j, n in enumerate(shape):
            k = nb - len(shape) + j
            ko = k - (nb - len(other))
            m = other[ko] if 0 <= ko < len(other) else 1
            if n == 1 and m != 1:
                letter = next(fresh)  # broadcast: repeated, never split
                no_shard.add(letter)
                out.append(letter)
            elif n != m and m != 1:
                raise ValueError(f"matmul: batch dims of x {x} and y {y} do not broadcast ({n} vs {m})")
            else:
                out.append(batch[k])
        return "".join(out)

    xl = batch_letters(xb, yb) + xm
    yl = batch_letters(yb, xb) + yn
    x_k = x.shape[-2] if (x.ndim > 1 and trans_x) else x.shape[-1]
    y_k = y.shape[-1] if (y.ndim > 1 and trans_y) else y.shape[-2] if y.ndim > 1 else y.shape[0]
    if x_k != y_k:
        raise ValueError(
            f"matmul: contraction sizes differ: x {x} (trans_x={trans_x}) has {x_k}, y {y} (trans_y={trans_y}) has {y_k}"
        )
    out = batch[:nb] + ("m" if x.ndim > 1 else "") + ("n" if y.ndim > 1 else "")
    return EinsumSpec(
        (xl, yl), (out,), (0, 1), False, frozenset({"sum", "avg"}), "sum", frozenset(no_shard), op="matmul"
    )
