"""The SPMD rule registry: per op, from input layouts to the layouts it runs on.

A rule answers two questions without running anything:

* ``infer_forward(op, inputs, **attrs)``: given the inputs' specs, which specs should the op's
  inputs be resharded to, and what are the outputs' specs (Partial included)?
* ``infer_backward(op, inputs, outputs, **attrs)``: given wanted output specs, which input
  specs produce them?

Rules are registered by decorator, keyed by Paddle's op name::

    @register_rule("relu")
    def relu_rule(inputs, **attrs) -> EinsumSpec: ...

A function returning an ``EinsumSpec`` is solved by the generic einsum rule
(``mpipar/spmd/einsum.py``); a ``Rule`` subclass may answer by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import solve_backward, solve_forward

SpecArg = DistSpec | Sequence[DistSpec]


@dataclass(frozen=True)
class SpmdResult:
    """What a rule decided: the input specs the op needs and the output specs it yields."""

    inputs: tuple[Any, ...]
    """One DistSpec per input; a tuple of specs for a list-valued input (concat)."""
    outputs: tuple[DistSpec, ...]
    rule: str = ""
    reason: str = field(default="", compare=False)
    """The decision in words: which mesh axis shards which index, and why."""

    def flat_inputs(self) -> list[DistSpec]:
        out: list[DistSpec] = []
        for x in self.inputs:
            if isinstance(x, DistSpec):
                out.append(x)
            else:
                out.extend(x)
        return out


class Rule:
    """An SPMD rule. Subclasses implement both inferences."""

    name = "rule"

    def infer_forward(self, inputs: Sequence[SpecArg], **attrs: Any) -> SpmdResult:
        raise NotImplementedError

    def infer_backward(self, inputs: Sequence[SpecArg], outputs: Sequence[DistSpec], **attrs: Any) -> SpmdResult:
        raise NotImplementedError


class EinsumRule(Rule):
    """A rule given as a function building an ``EinsumSpec`` from the inputs and attributes."""

    def __init__(self, name: str, build: Callable[..., Any]) -> None:
        self.name = name
        self.build = build

    def infer_forward(self, inputs: Sequence[SpecArg], **attrs: Any) -> SpmdResult:
        flat, shape_of = _flatten(inputs)
        espec = self.build(flat, **attrs)
        ins, outs, reason = solve_forward(espec, flat)
        return SpmdResult(shape_of(ins), tuple(outs), self.name, reason)

    def infer_forward_reusing(self, inputs: Sequence[SpecArg], reuse: Reuse, **attrs: Any) -> SpmdResult:
        flat, shape_of = _flatten(inputs)
        espec = self.build(flat, **attrs)
        ins, outs, reason = solve_forward(espec, flat, reuse)
        return SpmdResult(shape_of(ins), tuple(outs), self.name, reason)

    def infer_backward(self, inputs: Sequence[SpecArg], outputs: Sequence[DistSpec], **attrs: Any) -> SpmdResult:
        flat, shape_of = _flatten(inputs)
        espec = self.build(flat, **attrs)
        ins, outs, reason = solve_backward(espec, flat, list(outputs))
        return SpmdResult(shape_of(ins), tuple(outs), self.name, reason)


def _flatten(inputs: Sequence[SpecArg]) -> tuple[list[DistSpec], Callable[[Sequence[DistSpec]], tuple[Any, ...]]]:
    """Flatten list-valued inputs; return a function putting results back in the same nesting."""
    flat: list[DistSpec] = []
    layout: list[int | None] = []
    for x in inputs:
        if isinstance(x, DistSpec):
            flat.append(x)
            layout.append(None)
        else:
            items = list(x)
            if not all(isinstance(s, DistSpec) for s in items):
                raise TypeError(f"rule inputs must be DistSpecs or lists of DistSpecs, got {x!r}")
            flat.extend(items)
            layout.append(len(items))

    def unflatten(specs: Sequence[DistSpec]) -> tuple[Any, ...]:
        out: list[Any] = []
        i = 0
        for n in layout:
            if n is None:
                out.append(specs[i])
                i += 1
            else:
                out.append(tuple(specs[i : i + n]))
                i += n
        return tuple(out)

    for x in flat:
        if not isinstance(x, DistSpec):
            raise TypeError(f"rule inputs must be DistSpecs, got {type(x).__name__}")
    return flat, unflatten


_RULES: dict[str, Rule] = {}


def register_rule(name: str, rule: Rule | None = None) -> Callable[[Any], Any]:
    """Register an SPMD rule for ``name`` (decorator on a Rule class/instance or an EinsumSpec builder)."""

    def deco(obj: Any) -> Any:
        if isinstance(obj, Rule):
            _RULES[name] = obj
        elif isinstance(obj, type) and issubclass(obj, Rule):
            inst = obj()
            inst.name = name
            _RULES[name] = inst
        else:
            _RULES[name] = EinsumRule(name, obj)
        _cached_forward.cache_clear()
        return obj

    if rule is not None:
        return deco(rule)
    return deco


def has_rule(name: str) -> bool:
    return name in _RULES


def get_rule(name: str) -> Rule:
    try:
        return _RULES[name]
    except KeyError:
        raise KeyError(
            f"no SPMD rule is registered for op {name!r}. Register one with "
            f"@mpipar.spmd.register_rule({name!r}) on a function returning an EinsumSpec (see "
            "mpipar/spmd/rules/ for examples), or register the op with replicate_only=True to run "
            "it on replicated inputs"
        ) from None


def registered_rules() -> list[str]:
    return sorted(_RULES)


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


Reuse = tuple[tuple[int, frozenset[DistSpec]], ...]
"""Per flat input: the index of the first input holding the same value, and the specs that value
was already resharded to this step (an earlier consumer paid for those: they are free)."""


@lru_cache(maxsize=65536)
def _cached_forward(
    name: str, inputs: tuple[Any, ...], attrs: tuple[tuple[str, Any], ...], reuse: Reuse | None = None
) -> SpmdResult:
    rule = get_rule(name)
    if reuse is not None and isinstance(rule, EinsumRule):
        return rule.infer_forward_reusing(inputs, reuse, **dict(attrs))
    return rule.infer_forward(inputs, **dict(attrs))


def infer_forward(op: str, inputs: Sequence[SpecArg], **attrs: Any) -> SpmdResult:
    """The specs ``op`` needs its inputs in, and its output specs (Partial included).

    Raises ``ValueError`` for an impossible request (e.g. shapes that do not match).
    """
    key = tuple(x if isinstance(x, DistSpec) else tuple(x) for x in inputs)
    return _cached_forward(op, key, _freeze(attrs))


def infer_forward_reusing(op: str, inputs: Sequence[SpecArg], reuse: Reuse | None, **attrs: Any) -> SpmdResult:
    """``infer_forward`` pricing reshards already made as free (see ``Reuse``).

    ``multiply(y, y)`` with ``y`` Partial then reduces ``y`` once for both inputs instead of
    keeping one input Partial and reducing the product (and, in backward, two gradients) later.
    Rules that are not einsum rules answer as ``infer_forward``.
    """
    key = tuple(x if isinstance(x, DistSpec) else tuple(x) for x in inputs)
    return _cached_forward(op, key, _freeze(attrs), reuse)


def infer_backward(op: str, inputs: Sequence[SpecArg], outputs: Sequence[DistSpec], **attrs: Any) -> SpmdResult:
    """The input specs that give ``outputs`` (the backward direction of inference)."""
    return get_rule(op).infer_backward(inputs, outputs, **attrs)
