"""The generic SPMD rule: an op described by einsum-like index strings, solved per mesh axis.

An ``EinsumSpec`` names each dim of each input and output with a letter (``"mk,kn->mn"``
for matmul). Letters in an input but in no output are *contracted*. On every mesh axis the
rule picks one decision:

* ``R``: every input and output is Replicate on the axis;
* ``S(L)``: index ``L`` is split: inputs and outputs having ``L`` are Shard of that dim, the
  others Replicate; outputs lacking a split contracted index are ``Partial(contraction)``;
* ``P(op)``: a Partial input stays Partial and so do the outputs -- only for inputs the op is
  linear in (``linear_in``) and reduce types that commute with it (``partial_types``).
  ``jointly`` ops (add, concat, reductions) are linear in all those inputs together: they
  all become Partial (a Replicate one is made Partial locally, for free); multilinear ops
  (matmul, multiply) are linear in each input separately: the others must be Replicate.

Candidate decisions on an axis come from the inputs (an index some input already splits
there, a Partial some input has there, or Replicate): the rule never invents a sharding.

Conflict policy (documented, cost-aware): among all combinations of per-axis candidates,
choose the one whose input reshards receive the fewest bytes per rank (the reshard planner's
own cost), counting for a Partial kept through a multilinear op the reduction it defers to
the output (see ``_deferred_reduction``) and pricing as free a reshard an earlier consumer of
the same value already made, or another input of the op holding the same value makes (each
reshard once, ``mpipar.distribute.reshard``); ties go to fewer Partial outputs (a Partial must be
reduced later), then to leaving earlier inputs unchanged. Non-linear ops never consume
Partial: a Partial input of a non-linear op has no ``P`` candidate and is reduced by the
reshard the rule asks for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard
from mpipar.reshard.planner import plan_reshard
from mpipar.spec import DistSpec

LINEAR_PARTIALS = frozenset({"sum", "avg"})
ALL_PARTIALS = frozenset({"sum", "avg", "max", "min"})


@dataclass(frozen=True)
class EinsumSpec:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    linear_in: tuple[int, ...] = ()
    jointly: bool = True
    partial_types: frozenset[str] = LINEAR_PARTIALS
    contraction: str | None = "sum"
    """Reduce type of an output whose contracted index is split (None: never split one)."""
    no_shard: frozenset[str] = frozenset()
    """Indices that must stay whole (softmax's axis, a broadcast size-1 dim, a sliced dim)."""
    sizes: dict[str, int] = field(default_factory=dict, compare=False)
    """Sizes of output-only indices (default 1: keepdim and unsqueeze dims)."""
    op: str = ""

    @staticmethod
    def parse(equation: str, **kwargs: object) -> EinsumSpec:
        """``EinsumSpec.parse("mk,kn->mn", linear_in=(0, 1), jointly=False)``."""
        lhs, _, rhs = equation.partition("->")
        return EinsumSpec(tuple(lhs.split(",")), tuple(rhs.split(",")), **kwargs)  # type: ignore[arg-type]


Decision = tuple  # ("R",) | ("S", letter, zigzag) | ("P", input_index_or_None, reduce_type)


def _split(dec: Decision, dim: int) -> Shard:
    """The placement of an operand dim that decision ``("S", letter, zigzag)`` splits: a
    zigzag split stays zigzag in every operand with the letter (each keeps the letter's
    elements in the same storage order)."""
    return ZigzagShard(dim) if len(dec) > 2 and dec[2] else Shard(dim)


def _letter_sizes(es: EinsumSpec, specs: Sequence[DistSpec]) -> dict[str, int]:
    if len(specs) != len(es.inputs):
        raise ValueError(f"{es.op or 'op'} takes {len(es.inputs)} inputs, got {len(specs)}")
    sizes: dict[str, int] = {}
    owner: dict[str, int] = {}
    for i, (letters, spec) in enumerate(zip(es.inputs, specs, strict=True)):
        if len(letters) != len(spec.shape):
            raise ValueError(
                f"{es.op or 'op'}: input {i} {spec} has {len(spec.shape)} dims, the op expects {len(letters)} ({letters!r})"
            )
        for letter, n in zip(letters, spec.shape, strict=True):
            if letter in sizes and sizes[letter] != n:
                j = owner[letter]
                raise ValueError(
                    f"{es.op or 'op'}: input {j} {specs[j]} and input {i} {spec} disagree on the size of "
                    f"index {letter!r} ({sizes[letter]} vs {n})"
                )
            sizes.setdefault(letter, n)
            owner.setdefault(letter, i)
    for out in es.outputs:
        for letter in out:
            sizes.setdefault(letter, es.sizes.get(letter, 1))
    return sizes


def _check_mesh(es: EinsumSpec, specs: Sequence[DistSpec]) -> None:
    first = specs[0]
    for i, s in enumerate(specs[1:], 1):
        if not s.mesh.same_layout(first.mesh):
            raise ValueError(
                f"{es.op or 'op'}: input 0 {first} and input {i} {s} are on different meshes; "
                "reshard one of them explicitly (dist.reshard) before combining them"
            )


def _contracted(es: EinsumSpec) -> set[str]:
    ins = {c for s in es.inputs for c in s}
    outs = {c for s in es.outputs for c in s}
    return ins - outs


def _candidates(es: EinsumSpec, specs: Sequence[DistSpec], axis: int) -> list[Decision]:
    cands: list[Decision] = [("R",)]
    contracted = _contracted(es)
    for i, spec in enumerate(specs):
        p = spec.placements[axis]
        if isinstance(p, Shard):
            letter = es.inputs[i][p.dim]
            if letter in es.no_shard or (letter in contracted and es.contraction is None):
                continue
            dec: Decision = ("S", letter, isinstance(p, ZigzagShard))
        elif isinstance(p, Partial):
            if i not in es.linear_in or p.reduce_type not in es.partial_types:
                continue
            dec = ("P", None if es.jointly else i, p.reduce_type)
        else:
            continue
        if dec not in cands:
            cands.append(dec)
    return cands


def _build(
    es: EinsumSpec, specs: Sequence[DistSpec], sizes: dict[str, int], combo: Sequence[Decision]
) -> tuple[list[DistSpec], list[DistSpec]] | None:
    mesh = specs[0].mesh
    contracted = _contracted(es)
    # A letter split on an axis must be splittable in every operand that has it.
    ins: list[DistSpec] = []
    for i, letters in enumerate(es.inputs):
        pls: list[Placement] = []
        for dec in combo:
            if dec[0] == "S" and dec[1] in letters:
                pls.append(_split(dec, letters.index(dec[1])))
            elif dec[0] == "P" and (i == dec[1] or (dec[1] is None and i in es.linear_in)):
                pls.append(Partial(dec[2]))
            else:
                pls.append(Replicate())
        try:
            ins.append(DistSpec(specs[i].shape, mesh, pls))
        except ValueError:
            return None  # Partial types of different families on one input: not a layout
    outs: list[DistSpec] = []
    for letters in es.outputs:
        pls = []
        for dec in combo:
            if dec[0] == "S":
                if dec[1] in letters:
                    pls.append(_split(dec, letters.index(dec[1])))
                elif dec[1] in contracted or any(dec[1] in o for o in es.outputs):
                    if es.contraction is None:
                        return None
                    pls.append(Partial(es.contraction))
                else:
                    pls.append(Replicate())
            elif dec[0] == "P":
                pls.append(Partial(dec[2]))
            else:
                pls.append(Replicate())
        try:
            outs.append(DistSpec([sizes[c] for c in letters], mesh, pls))
        except ValueError:
            return None  # e.g. Partial types that do not commute
    return ins, outs


def _describe(es: EinsumSpec, mesh_names: Sequence[str], combo: Sequence[Decision]) -> str:
    parts = []
    for name, dec in zip(mesh_names, combo, strict=True):
        if dec[0] == "R":
            parts.append(f"{name}: replicate")
        elif dec[0] == "S":
            parts.append(f"{name}: split index {dec[1]}" + (" (zigzag)" if len(dec) > 2 and dec[2] else ""))
        else:
            who = "inputs" if dec[1] is None else f"input {dec[1]}"
            parts.append(f"{name}: keep {who} Partial({dec[2]})")
    eq = ",".join(es.inputs) + "->" + ",".join(es.outputs)
    return f"{eq}; " + "; ".join(parts)


def _reduce_elems(spec: DistSpec, axis: int) -> float:
    """Elements a rank receives to reduce ``spec``'s Partial on ``axis`` (an all-reduce there)."""
    pls = list(spec.placements)
    pls[axis] = Replicate()
    return plan_reshard(spec, spec.with_placements(pls)).recv_elems_per_rank()


def _deferred_reduction(es: EinsumSpec, combo: Sequence[Decision], outs: list[DistSpec]) -> float:
    """What keeping a Partial input Partial through a multilinear op costs later.

    ``P`` on an axis of a multilinear op (matmul, multiply) makes the other inputs Replicate
    there and moves the input's reduction to the output; the alternative combos pay that
    input's reduction now, among their reshards. A deferred reduction is not free: it costs the
    output's reduction, later -- more than the input's when the product is larger (a Partial
    output gradient times a gathered column-parallel weight), as much when it is the same size,
    in which case the weight it had to gather made it the dearer plan (Megatron's backward
    reduces the gradient first). A hair below the output's reduction is counted, so that a pure
    deferral (nothing gathered, no larger) still wins its tie: deferred Partials can merge, an
    add of two of them reducing once.
    """
    if es.jointly:
        return 0
    extra = 0.0
    for axis, dec in enumerate(combo):
        if dec[0] != "P" or dec[1] is None:
            continue
        extra += sum(_reduce_elems(o, axis) for o in outs) - 0.5
    return extra


def _reshard_cost(
    specs: Sequence[DistSpec], ins: Sequence[DistSpec], reuse: Sequence[tuple[int, frozenset[DistSpec]]] | None
) -> float:
    """Elements a rank receives to reshard ``specs`` to ``ins``; with ``reuse``, a reshard an
    earlier consumer made, or another input holding the same value makes, costs nothing."""
    cost = 0.0
    made: set[tuple[int, DistSpec]] = set()
    for i, (s, r) in enumerate(zip(specs, ins, strict=True)):
        if s == r:
            continue
        if reuse is not None:
            group, paid = reuse[i]
            if r in paid or (group, r) in made:
                continue
            made.add((group, r))
        cost += plan_reshard(s, r).recv_elems_per_rank()
    return cost


def solve_forward(
    es: EinsumSpec, specs: Sequence[DistSpec], reuse: Sequence[tuple[int, frozenset[DistSpec]]] | None = None
) -> tuple[list[DistSpec], list[DistSpec], str]:
    """Pick per-axis decisions for the inputs' current specs (see the module docstring).

    ``reuse`` (per input: the first input holding the same value, and the specs that value is
    already resharded to) prices a reshard made once for several consumers once."""
    _check_mesh(es, specs)
    sizes = _letter_sizes(es, specs)
    mesh = specs[0].mesh
    per_axis = [_candidates(es, specs, a) for a in range(mesh.ndim)]
    best: tuple[tuple[float, int, tuple[int, ...]], list[DistSpec], list[DistSpec], Sequence[Decision]] | None = None
    for combo in itertools.product(*per_axis):
        built = _build(es, specs, sizes, combo)
        if built is None:
            continue
        ins, outs = built
        cost = _reshard_cost(specs, ins, reuse)
        cost += _deferred_reduction(es, combo, outs)
        partial_outs = sum(len(o.partial_axes) for o in outs)
        changed = tuple(int(s != r) for s, r in zip(specs, ins, strict=True))
        key = (cost, partial_outs, changed)
        if best is None or key < best[0]:
            best = (key, ins, outs, combo)
    assert best is not None, "replicating everything is always a candidate"
    _, ins, outs, chosen = best
    return ins, outs, _describe(es, mesh.dim_names, chosen)


def solve_backward(
    es: EinsumSpec, specs: Sequence[DistSpec], out_specs: Sequence[DistSpec]
) -> tuple[list[DistSpec], list[DistSpec], str]:
    """Input specs that produce ``out_specs`` (decisions read off the outputs, first output wins).

    An output split on an index that must stay whole (softmax or cross entropy split on the
    axis they reduce, layer_norm on its normalised dims) is answered as Paddle's rules answer
    it: that mesh axis is replicated, the nearest layout the op can produce, and the returned
    outputs and reason say so; the caller reshards to them. Forward inference stays strict.
    """
    _check_mesh(es, specs)
    sizes = _letter_sizes(es, specs)
    if len(out_specs) != len(es.outputs):
        raise ValueError(f"{es.op or 'op'} has {len(es.outputs)} outputs, {len(out_specs)} specs given")
    mesh = specs[0].mesh
    contracted = sorted(_contracted(es) - es.no_shard)
    combo: list[Decision] = []
    nearest: list[str] = []
    for a in range(mesh.ndim):
        dec: Decision | None = None
        for o, spec in enumerate(out_specs):
            if not spec.mesh.same_layout(mesh):
                raise ValueError(f"{es.op or 'op'}: output spec {spec} is on another mesh than the inputs ({mesh})")
            p = spec.placements[a]
            if isinstance(p, Shard):
                letter = es.outputs[o][p.dim]
                if letter in es.no_shard:
                    nearest.append(
                        f"output {o} {spec} is split on dim {p.dim} (index {letter!r}), which must stay whole: "
                        f"replicated on mesh axis {mesh.dim_names[a]!r} instead (the nearest layout {es.op or 'the op'} produces)"
                    )
                    dec = ("R",)
                else:
                    dec = ("S", letter, isinstance(p, ZigzagShard))
            elif isinstance(p, Partial):
                from_inputs = [
                    (es.inputs[i][q.dim], isinstance(q, ZigzagShard))
                    for i, s in enumerate(specs)
                    if isinstance(q := s.placements[a], Shard) and es.inputs[i][q.dim] in contracted
                ]
                if p.reduce_type == es.contraction and (from_inputs or contracted):
                    dec = ("S", *(from_inputs or [(contracted[0], False)])[0])
                elif p.reduce_type in es.partial_types and es.linear_in:
                    holder = next(
                        (i for i in es.linear_in if isinstance(specs[i].placements[a], Partial)), es.linear_in[0]
                    )
                    dec = ("P", None if es.jointly else holder, p.reduce_type)
                else:
                    raise ValueError(
                        f"{es.op or 'op'} cannot produce output {o} {spec}: Partial({p.reduce_type}) on mesh axis "
                        f"{a} does not commute with the op"
                    )
            else:
                dec = ("R",)
            break
        combo.append(dec or ("R",))
    built = _build(es, specs, sizes, combo)
    if built is None:  # a zigzag split the combination cannot keep outermost: split plainly
        combo = [dec[:2] if dec[0] == "S" else dec for dec in combo]
        built = _build(es, specs, sizes, combo)
    if built is None:
        raise ValueError(f"{es.op or 'op'}: no input layout produces outputs {[str(s) for s in out_specs]}")
    ins, outs = built
    return ins, outs, "; ".join([_describe(es, mesh.dim_names, combo), *nearest])
