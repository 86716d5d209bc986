"""Rules of the Llama blocks' ops: rms_norm, silu, swiglu, rotary embedding.

* rms_norm: as layer_norm without a bias: the normalised dims stay whole, batch dims (and the
  sequence: sequence and context parallel) may be split, which makes the weight's gradient
  Partial(sum).
* silu, swiglu: elementwise; swiglu(x, y) = silu(x) * y is linear in y alone (a Partial y
  meets a replicated x), never in x.
* fused_rotary_position_embedding(x (B, S, H, D), positions (S,)): linear in x; the sequence
  is split together with the positions (so every token is rotated by its global position),
  heads and batch freely; the head dim stays whole (its halves are rotated into each other).
"""

from __future__ import annotations

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import EinsumSpec
from mpipar.spmd.registry import register_rule
from mpipar.spmd.rules.elementwise import elementwise
from mpipar.spmd.rules.nn import norm_letters


@register_rule("rms_norm")
def rms_norm_rule(specs: list[DistSpec], begin_norm_axis: int = -1, **_: object) -> EinsumSpec:
    letters, batch, normed = norm_letters(specs[0], begin_norm_axis, "rms_norm")
    return EinsumSpec((letters, normed), (letters, batch), no_shard=frozenset(normed), op="rms_norm")


@register_rule("rms_norm_grad")
def rms_norm_grad_rule(specs: list[DistSpec], begin_norm_axis: int = -1, **_: object) -> EinsumSpec:
    # inputs: x, weight, rstd, dy  ->  dx, dweight (summed over the batch dims)
    letters, batch, normed = norm_letters(specs[0], begin_norm_axis, "rms_norm")
    return EinsumSpec(
        (letters, normed, batch, letters),
        (letters, normed),
        linear_in=(3,),
        no_shard=frozenset(normed),
        contraction="sum",
        op="rms_norm_grad",
    )


register_rule("silu")(lambda specs, **a: elementwise("silu", specs))
register_rule("silu_grad")(lambda specs, **a: elementwise("silu_grad", specs, (1,), True))
register_rule("swiglu")(lambda specs, **a: elementwise("swiglu", specs, (1,), False))


@register_rule("swiglu_grad")
def swiglu_grad_rule(specs: list[DistSpec], **_: object) -> EinsumSpec:
    es = elementwise("swiglu_grad", specs, (2,), True)  # x, y, dout -> dx, dy: linear in dout
    return EinsumSpec(es.inputs, es.outputs * 2, es.linear_in, es.jointly, no_shard=es.no_shard, op="swiglu_grad")


@register_rule("fused_rotary_position_embedding")
def rope_rule(specs: list[DistSpec], **_: object) -> EinsumSpec:
    x, pos = specs
    if x.ndim != 4 or pos.ndim != 1:
        raise ValueError(
            f"fused_rotary_position_embedding: x must be (batch, seq, heads, head_dim) and positions (seq,), got {x} and {pos}"
        )
    return EinsumSpec(("bshd", "s"), ("bshd",), linear_in=(0,), jointly=False, no_shard=frozenset("d"), op="rope")
