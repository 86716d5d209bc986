"""Rules of reductions: sum, mean (linear: a split reduced dim gives Partial(sum)), max, min."""

from __future__ import annotations

from collections.abc import Sequence

from mpipar.spec import DistSpec
from mpipar.spmd.einsum import LINEAR_PARTIALS, EinsumSpec
from mpipar.spmd.registry import register_rule
from mpipar.spmd.rules.common import LOWER, UPPER, norm_axes


def reduction(
    op: str,
    specs: list[DistSpec],
    axis: int | Sequence[int] | None,
    keep_dim: bool,
    partials: frozenset[str],
    contraction: str,
) -> EinsumSpec:
    (x,) = specs
    axes = norm_axes(axis, x.ndim, op)
    letters = LOWER[: x.ndim]
    out = []
    for d, c in enumerate(letters):
        if d in axes:
            if keep_dim:
                out.append(UPPER[d])  # a new size-1 dim
        else:
            out.append(c)
    return EinsumSpec((letters,), ("".join(out),), (0,), True, partials, contraction, op=op)


def _attrs(kw: dict[str, object]) -> tuple[object, bool]:
    keep = kw.get("keep_dim", kw.get("keepdim", False))
    return kw.get("axis"), bool(keep)


for _name in ("sum", "mean"):
    register_rule(_name)(
        lambda specs, _n=_name, **kw: reduction(_n, specs, *_attrs(kw), LINEAR_PARTIALS, "sum")  # type: ignore[arg-type]
    )
register_rule("max")(lambda specs, **kw: reduction("max", specs, *_attrs(kw), frozenset({"max"}), "max"))  # type: ignore[arg-type]
register_rule("min")(lambda specs, **kw: reduction("min", specs, *_attrs(kw), frozenset({"min"}), "min"))  # type: ignore[arg-type]
