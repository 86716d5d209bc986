"""Rules of layout ops: transpose, unsqueeze, squeeze, split, concat, slice, reshape.

They only move elements, so every Partial type passes through them. A dim being cut
(split, concat, a partial slice) must stay whole. ``reshape`` keeps a split only where the
chunks of the old dim are exactly the chunks of the new one (see ``ReshapeRule``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard, like
from mpipar.spec import DistSpec
from mpipar.spmd.einsum import ALL_PARTIALS, EinsumSpec
from mpipar.spmd.registry import Rule, SpmdResult, register_rule
from mpipar.spmd.rules.common import LOWER, UPPER, norm_axes, norm_axis


def _layout(
    op: str, ins: Sequence[str], outs: Sequence[str], no_shard: set[str], sizes: dict[str, int] | None = None
) -> EinsumSpec:
    return EinsumSpec(
        tuple(ins),
        tuple(outs),
        tuple(range(len(ins))),
        True,
        ALL_PARTIALS,
        None,
        frozenset(no_shard),
        sizes or {},
        op=op,
    )


@register_rule("transpose")
def transpose_rule(specs: list[DistSpec], perm: Sequence[int] = (), **_: object) -> EinsumSpec:
    (x,) = specs
    perm = [norm_axis(int(p), x.ndim, "transpose", "perm entry") for p in perm]
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: perm {list(perm)} is not a permutation of the {x.ndim} dims of {x}")
    letters = LOWER[: x.ndim]
    return _layout("transpose", [letters], ["".join(letters[p] for p in perm)], set())


@register_rule("unsqueeze")
def unsqueeze_rule(specs: list[DistSpec], axis: int | Sequence[int] = 0, **_: object) -> EinsumSpec:
    (x,) = specs
    axes = [axis] if isinstance(axis, int) else list(axis)
    out_ndim = x.ndim + len(axes)
    new = {norm_axis(int(a), out_ndim, "unsqueeze") for a in axes}
    letters = iter(LOWER[: x.ndim])
    out = "".join(UPPER[i] if i in new else next(letters) for i in range(out_ndim))
    return _layout("unsqueeze", [LOWER[: x.ndim]], [out], set())


@register_rule("squeeze")
def squeeze_rule(specs: list[DistSpec], axis: int | Sequence[int] | None = None, **_: object) -> EinsumSpec:
    (x,) = specs
    if axis is None:
        axes = {d for d, n in enumerate(x.shape) if n == 1}
    else:
        axes = {d for d in norm_axes(axis, x.ndim, "squeeze") if x.shape[d] == 1}
    letters = LOWER[: x.ndim]
    out = "".join(c for d, c in enumerate(letters) if d not in axes)
    return _layout("squeeze", [letters], [out], {letters[d] for d in axes})


@register_rule("split")
def split_rule(specs: list[DistSpec], num_or_sections: Any = 2, axis: int = 0, **_: object) -> EinsumSpec:
    (x,) = specs
    a = norm_axis(axis, x.ndim, "split")
    sections = split_sections(x.shape[a], num_or_sections, f"split of {x}")
    letters = LOWER[: x.ndim]
    outs, sizes = [], {}
    for i, n in enumerate(sections):
        c = UPPER[i]
        outs.append(letters[:a] + c + letters[a + 1 :])
        sizes[c] = n
    return _layout("split", [letters], outs, {letters[a]}, sizes)


@register_rule("split_with_num")
def split_with_num_rule(specs: list[DistSpec], num: Any = 2, axis: int = 0, **_: object) -> EinsumSpec:
    """Paddle's ``split_with_num`` (``paddle.split`` given an int): ``split`` into ``num`` equal parts."""
    if isinstance(num, bool) or not isinstance(num, int):
        raise TypeError(f"split_with_num: num={num!r} must be an int count of equal parts; for sizes use split")
    return split_rule(specs, num_or_sections=num, axis=axis)


def split_sections(size: int, num_or_sections: Any, what: str) -> list[int]:
    """Paddle's num_or_sections: an int count of equal parts, or sizes (one may be -1)."""
    if isinstance(num_or_sections, int):
        if num_or_sections <= 0 or size % num_or_sections:
            raise ValueError(f"{what}: cannot split a dim of size {size} into {num_or_sections} equal parts")
        return [size // num_or_sections] * num_or_sections
    secs = [int(s) for s in num_or_sections]
    if secs.count(-1) > 1:
        raise ValueError(f"{what}: at most one section may be -1, got {secs}")
    if -1 in secs:
        secs[secs.index(-1)] = size - (sum(secs) + 1)
    if sum(secs) != size or any(s < 0 for s in secs):
        raise ValueError(f"{what}: sections {list(num_or_sections)} do not add up to the dim size {size}")
    return secs


@register_rule("concat")
def concat_rule(specs: list[DistSpec], axis: int = 0, **_: object) -> EinsumSpec:
    x = specs[0]
    a = norm_axis(axis, x.ndim, "concat")
    letters = LOWER[: x.ndim]
    ins = []
    for i, s in enumerate(specs):
        if s.ndim != x.ndim:
            raise ValueError(f"concat: input 0 {x} and input {i} {s} have different numbers of dims")
        ins.append(letters[:a] + UPPER[i] + letters[a + 1 :])
    total = sum(s.shape[a] for s in specs)
    out = letters[:a] + "Z" + letters[a + 1 :]
    return _layout("concat", ins, [out], {UPPER[i] for i in range(len(specs))}, {"Z": total})


@register_rule("slice")
def slice_rule(
    specs: list[DistSpec], axes: Sequence[int] = (), starts: Sequence[int] = (), ends: Sequence[int] = (), **_: object
) -> EinsumSpec:
    (x,) = specs
    letters = list(LOWER[: x.ndim])
    out = list(letters)
    no_shard, sizes = set(), {}
    for a, (s, e) in slice_bounds(x.shape, axes, starts, ends).items():
        if (s, e) != (0, x.shape[a]):
            no_shard.add(letters[a])
            out[a] = UPPER[a]
            sizes[UPPER[a]] = e - s
    return _layout("slice", ["".join(letters)], ["".join(out)], no_shard, sizes)


def slice_bounds(
    shape: Sequence[int], axes: Sequence[int], starts: Sequence[int], ends: Sequence[int]
) -> dict[int, tuple[int, int]]:
    """Paddle's slice attributes as clamped (start, stop) per axis."""
    if not len(axes) == len(starts) == len(ends):
        raise ValueError(f"slice: axes {list(axes)}, starts {list(starts)} and ends {list(ends)} differ in length")
    out = {}
    for a, s, e in zip(axes, starts, ends, strict=True):
        d = norm_axis(int(a), len(shape), "slice")
        out[d] = range(shape[d])[slice(int(s), int(e))].start, range(shape[d])[slice(int(s), int(e))].stop
        start, stop = out[d]
        out[d] = (start, max(start, stop))
    return out


class ReshapeRule(Rule):
    """Reshape keeps a Shard only where old and new chunks hold the same elements.

    Dims are grouped so that each group of old dims and its group of new dims have the same
    number of elements. A split of the first old dim of a group carries over to the first new
    dim of the group when, on every rank, the flat range of its chunk is also the flat range
    of a chunk of the new dim under the chunking rule (so uneven cases are exact). Any other
    split is gathered first. Partial passes through.
    """

    def infer_forward(self, inputs: Sequence[Any], shape: Sequence[int] = (), **_: object) -> SpmdResult:
        (x,) = inputs
        target = resolve_shape(x.shape, shape)
        pls, out_pls = self._solve(x, target)
        need = x.with_placements(pls)
        out = DistSpec(target, x.mesh, out_pls)
        return SpmdResult(
            (need,),
            (out,),
            "reshape",
            f"reshape {list(x.shape)} -> {target}: {need.placements_str} -> {out.placements_str}",
        )

    def infer_backward(
        self, inputs: Sequence[Any], outputs: Sequence[DistSpec], shape: Sequence[int] = (), **_: object
    ) -> SpmdResult:
        (x,) = inputs
        (out,) = outputs
        # Solving the inverse reshape from the wanted output gives the input layout.
        pls, in_pls = self._solve(out, list(x.shape))
        need = DistSpec(x.shape, x.mesh, in_pls)
        return SpmdResult((need,), (out.with_placements(pls),), "reshape", "inverse reshape of the wanted output")

    @staticmethod
    def _solve(x: DistSpec, target: list[int]) -> tuple[list[Placement], list[Placement]]:
        groups = dim_groups(list(x.shape), target)
        first_of = {g_in[0]: (g_in, g_out) for g_in, g_out in groups if g_in and g_out}
        pls: list[Placement] = list(x.placements)
        while True:
            out_pls: list[Placement] = []
            bad_axis = None
            for a, p in enumerate(pls):
                if isinstance(p, Shard):
                    if p.dim not in first_of or (isinstance(p, ZigzagShard) and not _one_to_one(x, target, p.dim)):
                        bad_axis = a  # a zigzag split survives only a dim kept as it is
                        break
                    out_pls.append(like(p, first_of[p.dim][1][0]))
                else:
                    out_pls.append(p if isinstance(p, Partial) else Replicate())
            if bad_axis is None:
                cand_in = DistSpec(x.shape, x.mesh, pls)
                cand_out = DistSpec(target, x.mesh, out_pls)
                bad_axis = _first_mismatch(cand_in, cand_out, groups)
                if bad_axis is None:
                    return pls, out_pls
            pls[bad_axis] = Replicate()


def _one_to_one(x: DistSpec, target: list[int], dim: int) -> bool:
    """Does ``dim`` map onto one dim of the same size (so its storage order carries over)?"""
    return any(
        g_in == [dim] and len(g_out) == 1 and target[g_out[0]] == x.shape[dim]
        for g_in, g_out in dim_groups(list(x.shape), target)
    )


def _first_mismatch(x: DistSpec, out: DistSpec, groups: list[tuple[list[int], list[int]]]) -> int | None:
    """The highest mesh axis whose split breaks the flat-range equality, or None."""
    for g_in, g_out in groups:
        if not g_in or not g_out:
            continue
        d, o = g_in[0], g_out[0]
        inner_in = _prod(x.shape[i] for i in g_in[1:])
        inner_out = _prod(out.shape[i] for i in g_out[1:])
        axes = x.shard_axes(d)
        if not axes:
            continue
        for r in x.mesh.process_ids:
            (s_in, e_in), (s_out, e_out) = x.local_box(r)[d], out.local_box(r)[o]
            if s_in == e_in and s_out == e_out:
                continue
            if (s_in * inner_in, e_in * inner_in) != (s_out * inner_out, e_out * inner_out):
                return max(axes)
    return None


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def resolve_shape(shape: Sequence[int], target: Sequence[int]) -> list[int]:
    """Paddle's reshape target: 0 copies the input dim, one -1 is inferred."""
    out = [int(shape[i]) if int(t) == 0 and i < len(shape) else int(t) for i, t in enumerate(target)]
    total = _prod(shape)
    if out.count(-1) > 1:
        raise ValueError(f"reshape of {list(shape)} to {list(target)}: at most one dim may be -1")
    if -1 in out:
        known = _prod(n for n in out if n != -1)
        if known == 0 or total % known:
            raise ValueError(f"reshape of {list(shape)} to {list(target)}: cannot infer the -1 dim")
        out[out.index(-1)] = total // known
    if _prod(out) != total or any(n < 0 for n in out):
        raise ValueError(
            f"reshape of {list(shape)} ({total} elements) to {list(target)} ({_prod(out)} elements) is impossible"
        )
    return out


def dim_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of source and target dims with equal element counts (size-1 dims alone)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        g_in, g_out = [i], [j]
        p_in, p_out = src[i], dst[j]
        i += 1
        j += 1
        while p_in != p_out:
            if p_in < p_out:
                g_in.append(i)
                p_in *= src[i]
                i += 1
            else:
                g_out.append(j)
                p_out *= dst[j]
                j += 1
        groups.append((g_in, g_out))
    return groups


register_rule("reshape", ReshapeRule())


@register_rule("expand")
def expand_rule(specs: list[DistSpec], shape: Sequence[int] = (), **_: object) -> EinsumSpec:
    (x,) = specs
    target = [int(n) for n in shape]
    if len(target) < x.ndim:
        raise ValueError(f"expand of {x} to {target}: the target has fewer dims than the input")
    lead = len(target) - x.ndim
    out = LOWER[: len(target)]
    letters, no_shard, sizes = [], set(), {}
    for j, n in enumerate(x.shape):
        t = target[lead + j]
        if t in (-1, n):
            letters.append(out[lead + j])
        elif n == 1:
            letters.append(UPPER[j])  # repeated, never split
            no_shard.add(UPPER[j])
        else:
            raise ValueError(f"expand of {x} to {target}: dim {j} of size {n} cannot become {t}")
    for k in range(len(target)):
        sizes[out[k]] = x.shape[k - lead] if k >= lead and target[k] == -1 else target[k]
    return _layout("expand", ["".join(letters)], [out], no_shard, sizes)


@register_rule("slice_grad")
def slice_grad_rule(
    specs: list[DistSpec],
    input_shape: Sequence[int] = (),
    axes: Sequence[int] = (),
    starts: Sequence[int] = (),
    ends: Sequence[int] = (),
    **_: object,
) -> EinsumSpec:
    (g,) = specs
    letters = list(LOWER[: g.ndim])
    ins = list(letters)
    no_shard, sizes = set(), {}
    for a, (s, e) in slice_bounds(input_shape, axes, starts, ends).items():
        if (s, e) != (0, input_shape[a]):
            ins[a] = UPPER[a]
            no_shard.add(UPPER[a])
            no_shard.add(letters[a])
            sizes[letters[a]] = int(input_shape[a])
    es = _layout("slice_grad", ["".join(ins)], ["".join(letters)], no_shard, sizes)
    return es
