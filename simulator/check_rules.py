"""Fuzz every registered SPMD rule against the dense result.

    python -m simulator.check_rules [--trials 6] [--seed 0] [--ops matmul,add] [-v]

For each op with a rule, each of its sample inputs, several meshes (1-d even and uneven,
2-d) and random input placements (Shard, Replicate, Partial of every type the dtype
allows): ask the rule for the layouts (``infer_forward``), lay the inputs out exactly as
the rule asks, run the op's local kernel on every rank *without* any further reshard, and
compare the outputs -- read with the placements the rule claims -- with the kernel's dense
result. Then ask ``infer_backward`` for the forward outputs' layouts and check those too.

Reports wrong rules (a claimed layout that does not hold the dense value, or a local shape
that disagrees with it) and missing rules (an op without a rule that is not marked
replicate-only). Exits non-zero if there is any.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import mpipar as dist
from mpipar.backend import use_backend
from mpipar.ops.dispatch import KernelContext, OpDef, registered_ops
from mpipar.placement import Partial, Placement, Replicate, Shard, ZigzagShard
from mpipar.spec import DistSpec, full_box
from mpipar.spmd import registry
from simulator.backend import SimBackend
from simulator.partial import random_partial_tensor

MESHES = [[2], [3], [2, 2], [2, 3]]


@dataclass
class OpReport:
    op: str
    cases: int = 0
    wrong: list[str] = field(default_factory=list)
    missing: str = ""


def _flat(inputs: Sequence[Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for x in inputs:
        if isinstance(x, list):
            out.extend(np.asarray(v) for v in x)
        else:
            out.append(np.asarray(x))
    return out


def _nest_like(inputs: Sequence[Any], flat: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    i = 0
    for x in inputs:
        if isinstance(x, list):
            out.append(list(flat[i : i + len(x)]))
            i += len(x)
        else:
            out.append(flat[i])
            i += 1
    return out


def _random_placements(rng: np.random.Generator, mesh: dist.ProcessMesh, value: np.ndarray) -> list[Placement]:
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(value.ndim)]
    # The load-balanced split where a dim divides into 2k chunks on every axis (kept only where
    # it is the dim's outermost split, as the spec requires).
    options += [
        ZigzagShard(d)
        for d in range(value.ndim)
        if value.shape[d] and all(value.shape[d] % (2 * k) == 0 for k in mesh.shape)
    ]
    if np.issubdtype(value.dtype, np.floating):
        options += [Partial(op) for op in ("sum", "avg", "max", "min")]
    pls = [options[rng.integers(len(options))] for _ in range(mesh.ndim)]
    pls = [
        Shard(p.dim)
        if isinstance(p, ZigzagShard) and any(isinstance(q, Shard) and q.dim == p.dim for q in pls[:a])
        else p
        for a, p in enumerate(pls)
    ]
    types = {p.reduce_type for p in pls if isinstance(p, Partial)}
    if len(types) > 1 and not types <= {"sum", "avg"}:  # keep the spec legal: one family
        pls = [Replicate() if isinstance(p, Partial) else p for p in pls]
    return pls


def _dense(op: OpDef, arrays: list[np.ndarray], inputs: Sequence[Any], attrs: dict[str, Any]) -> list[np.ndarray]:
    mesh = dist.ProcessMesh([0], ["dense"])
    specs = [DistSpec(a.shape, mesh, [Replicate()]) for a in arrays]
    res = registry.infer_forward(op.rule_name, _nest_like(inputs, specs), **_rule_attrs(op, attrs))
    ctx = KernelContext(
        specs, list(res.outputs), [full_box(a.shape) for a in arrays], [full_box(s.shape) for s in res.outputs]
    )
    out = op.kernel(ctx, *arrays, **attrs)
    return [np.asarray(o) for o in (out if op.multi_output else [out])]


def _rule_attrs(op: OpDef, attrs: dict[str, Any]) -> dict[str, Any]:
    return attrs if op.rule_attrs is None else {k: attrs[k] for k in op.rule_attrs if k in attrs}


def _run_on_layouts(
    op: OpDef,
    arrays: list[np.ndarray],
    need: list[DistSpec],
    outs: list[DistSpec],
    attrs: dict[str, Any],
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Lay inputs out as ``need`` (Partial as random contributions), run the kernel per rank,
    read outputs as ``outs``."""
    tensors = [random_partial_tensor(a, s, rng) for a, s in zip(arrays, need, strict=True)]
    per_rank: dict[int, list[Any]] = {}
    for r in need[0].mesh.process_ids:
        ctx = KernelContext(need, outs, [s.boxes[r] for s in need], [s.boxes[r] for s in outs])
        res = op.kernel(ctx, *[t.local_tensor(r) for t in tensors], **attrs)
        per_rank[r] = list(res) if op.multi_output else [res]
    values = []
    for j, spec in enumerate(outs):
        shards = {}
        for r, res in per_rank.items():
            arr = np.asarray(res[j])
            if arr.shape != spec.local_shape(r):
                raise AssertionError(
                    f"output {j} on rank {r} has local shape {list(arr.shape)}, {spec} says {list(spec.local_shape(r))}"
                )
            shards[r] = arr
        values.append(dist.Tensor._from_shards(spec, shards, next(iter(shards.values())).dtype).full_tensor())
    return values


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape:
        return False
    if np.issubdtype(want.dtype, np.floating):
        # Random partial contributions cancel in the reduction: allow a few ulps of their size.
        return bool(np.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True))
    return bool(np.array_equal(got, want))


def check_op(op: OpDef, rng: np.random.Generator, trials: int, verbose: bool = False) -> OpReport:
    report = OpReport(op.name)
    if op.replicate_only:
        return report
    if not registry.has_rule(op.rule_name):
        report.missing = f"op {op.name!r} has no SPMD rule {op.rule_name!r} and is not marked replicate_only"
        return report
    if op.sample is None:
        report.missing = f"op {op.name!r} has no sample inputs: the checker cannot test its rule"
        return report
    for inputs, attrs in op.sample(rng):
        arrays = _flat(inputs)
        want = _dense(op, arrays, inputs, attrs)
        for mesh_shape in MESHES:
            mesh = dist.ProcessMesh(np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape))
            for _ in range(trials):
                specs = [DistSpec(a.shape, mesh, _random_placements(rng, mesh, a)) for a in arrays]
                case = f"{op.name}{_short(attrs)} inputs {[str(s.placements_str) for s in specs]} on mesh {mesh_shape}"
                report.cases += 1
                try:
                    res = registry.infer_forward(op.rule_name, _nest_like(inputs, specs), **_rule_attrs(op, attrs))
                    need, outs = res.flat_inputs(), list(res.outputs)
                    got = _run_on_layouts(op, arrays, need, outs, attrs, rng)
                    bad = [j for j, (g, w) in enumerate(zip(got, want, strict=True)) if not _close(g, w)]
                    if bad:
                        report.wrong.append(
                            f"forward {case}: rule says {[s.placements_str for s in need]} -> {[s.placements_str for s in outs]}; output(s) {bad} differ from the dense result"
                        )
                        continue
                    back = registry.get_rule(op.rule_name).infer_backward(
                        _nest_like(inputs, specs), outs, **_rule_attrs(op, attrs)
                    )
                    need_b = back.flat_inputs()
                    got_b = _run_on_layouts(op, arrays, need_b, list(back.outputs), attrs, rng)
                    if any(not _close(g, w) for g, w in zip(got_b, want, strict=True)):
                        report.wrong.append(
                            f"backward {case}: infer_backward gives {[s.placements_str for s in need_b]} -> {[s.placements_str for s in back.outputs]}, which does not hold the dense result"
                        )
                except Exception as exc:  # a crash on a legal input is a wrong rule too
                    detail = traceback.format_exc(limit=3) if verbose else f"{type(exc).__name__}: {exc}"
                    report.wrong.append(f"{case}: {detail}")
    return report


def _short(attrs: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in attrs.items() if k != "key") + ")" if attrs else ""


def check_all(
    trials: int = 6, seed: int = 0, ops: Sequence[str] | None = None, verbose: bool = False
) -> list[OpReport]:
    rng = np.random.default_rng(seed)
    reports = []
    with use_backend(SimBackend()):
        for op in registered_ops():
            if ops and op.name not in ops:
                continue
            reports.append(check_op(op, rng, trials, verbose))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.check_rules", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6, help="random placements per sample and mesh")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true")
    ns = parser.parse_args(argv)
    reports = check_all(ns.trials, ns.seed, [o for o in ns.ops.split(",") if o] or None, ns.verbose)
    total = sum(r.cases for r in reports)
    wrong = [r for r in reports if r.wrong]
    missing = [r for r in reports if r.missing]
    for r in reports:
        status = "MISSING" if r.missing else (f"WRONG ({len(r.wrong)})" if r.wrong else "ok")
        print(f"{r.op:34s} {r.cases:5d} cases  {status}")
    for r in missing:
        print(f"\nmissing rule: {r.missing}")
    for r in wrong:
        print(f"\nwrong rule for {r.op}:")
        for line in r.wrong[:5]:
            print(f"  {line}")
        if len(r.wrong) > 5:
            print(f"  ... and {len(r.wrong) - 5} more")
    print(f"\n{len(reports)} ops, {total} cases: {len(wrong)} wrong, {len(missing)} missing")
    return 1 if wrong or missing else 0


if __name__ == "__main__":
    sys.exit(main())
