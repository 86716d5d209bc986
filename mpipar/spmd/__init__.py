"""SPMD rules: queryable without running anything.

>>> from mpipar import spmd
>>> r = spmd.infer_forward("matmul", [x_spec, w_spec], trans_x=False, trans_y=False)
>>> r.inputs, r.outputs        # the layouts the op runs on; outputs may be Partial
"""

from mpipar.spmd import rules  # noqa: F401  (importing the package registers every built-in rule)
from mpipar.spmd.einsum import EinsumSpec
from mpipar.spmd.registry import (
    Rule,
    SpmdResult,
    get_rule,
    has_rule,
    infer_backward,
    infer_forward,
    register_rule,
    registered_rules,
)

__all__ = [
    "EinsumSpec",
    "Rule",
    "SpmdResult",
    "get_rule",
    "has_rule",
    "infer_backward",
    "infer_forward",
    "register_rule",
    "registered_rules",
]
