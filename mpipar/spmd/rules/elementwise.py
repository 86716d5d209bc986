"""Rules of elementwise ops (NumPy broadcasting), comparisons, dropout and elementwise grads."""

from __future__ import annotations

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import ALL_PARTIALS, LINEAR_PARTIALS, EinsumSpec
from mpipar.spmd.registry import register_rule
from mpipar.spmd.rules.common import broadcast_letters


def elementwise(
    op: str,
    specs: list[DistSpec],
    linear_in: tuple[int, ...] = (),
    jointly: bool = True,
    partial_types: frozenset[str] = LINEAR_PARTIALS,
) -> EinsumSpec:
    ins, out, no_shard = broadcast_letters(specs, op)
    return EinsumSpec(ins, (out,), linear_in, jointly, partial_types, None, no_shard, op=op)


# Linear in all inputs together: the sum of partials is the partial of the sum.
for _name in ("add", "subtract"):
    register_rule(_name)(lambda specs, _n=_name, **a: elementwise(_n, specs, (0, 1), True))

# Linear in each input separately: a partial may meet only a replicated operand.
register_rule("multiply")(lambda specs, **a: elementwise("multiply", specs, (0, 1), False))
# Linear in the numerator only.
register_rule("divide")(lambda specs, **a: elementwise("divide", specs, (0,), True))
# where(cond, x, y) is linear in (x, y) together; cond is not.
register_rule("where")(lambda specs, **a: elementwise("where", specs, (1, 2), True))
# Negation and scaling by a constant are linear; max/min would swap under negative factors.
for _name in ("neg", "scale"):
    register_rule(_name)(lambda specs, _n=_name, **a: elementwise(_n, specs, (0,), True))


# Dropout outputs (x * mask / (1-p), mask). The mask is the same wherever an element lives, so
# it cannot follow a Partial input: a Partial x is reduced first.
@register_rule("dropout")
def dropout_rule(specs: list[DistSpec], **_: object) -> EinsumSpec:
    ins, out, no_shard = broadcast_letters(specs, "dropout")
    return EinsumSpec(ins, (out, out), no_shard=no_shard, op="dropout")


register_rule("dropout_grad")(lambda specs, **a: elementwise("dropout_grad", specs, (1,), True))
# Assign/identity copies and casts between float types.
register_rule("assign")(lambda specs, **a: elementwise("assign", specs, (0,), True, ALL_PARTIALS))

# Non-linear: a Partial input is reduced first.
for _name in (
    "relu",
    "gelu",
    "exp",
    "log",
    "tanh",
    "sqrt",
    "rsqrt",
    "sigmoid",
    "abs",
    "square",
    "pow",
    "cast",
    "maximum",
    "minimum",
    "greater_than",
    "less_than",
    "greater_equal",
    "less_equal",
    "equal",
    "not_equal",
    "logical_and",
    "logical_or",
    "logical_not",
    "isfinite",
):
    register_rule(_name)(lambda specs, _n=_name, **a: elementwise(_n, specs))

# Gradients of pointwise ops: linear in the incoming gradient (the last input).
for _name in ("relu_grad", "gelu_grad", "tanh_grad", "sigmoid_grad", "sqrt_grad", "pow_grad"):
    register_rule(_name)(lambda specs, _n=_name, **a: elementwise(_n, specs, (len(specs) - 1,), True))
