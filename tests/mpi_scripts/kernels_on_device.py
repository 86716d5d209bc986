"""Every registered op's forward and backward on the running backend's arrays, saved for comparison.

    mpiexec -n 2 python tests/mpi_scripts/kernels_on_device.py --out kernels.npz
    MPIPAR_BACKEND=nccl mpiexec -n 1 python tests/mpi_scripts/kernels_on_device.py --out kernels-gpu.npz
    python tests/mpi_scripts/kernels_on_device.py --compare kernels.npz kernels-gpu.npz [--rtol 1e-9]

For each op with checker samples (the first two of each), the inputs are replicated over a mesh
of every rank, so each rank's kernel runs on whole arrays of the backend's own module (CuPy under
the NCCL backend, NumPy under MPI), and the gradients come from ``sum(output * cotangent)``'s
backward. Rank 0 saves every output and gradient as NumPy arrays in ``--out``. Two runs on
different backends are then compared: bit for bit between the MPI backend and the CI stand-in for
CuPy (both NumPy memory), within float rounding between NumPy and a real GPU. An op whose kernel
fails is saved as an error message (``<op>/<sample>/error``), so one run names every failing op.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

import mpipar as dist
from mpipar._xp import to_numpy
from mpipar.ops import apply, get_op, registered_ops


def nest_inputs(inputs: list[Any], flat: list[Any]) -> list[Any]:
    """``flat`` regrouped as a checker sample's ``inputs`` nest them (a list input takes as many)."""
    out, i = [], 0
    for x in inputs:
        if isinstance(x, list):
            out.append(flat[i : i + len(x)])
            i += len(x)
        else:
            out.append(flat[i])
            i += 1
    return out


def _flat(inputs: list[Any]) -> list[np.ndarray]:
    return [np.asarray(v) for x in inputs for v in (x if isinstance(x, list) else [x])]


def run_sample(
    name: str, inputs: list[Any], attrs: dict[str, Any], mesh: dist.ProcessMesh, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """The op's outputs and its inputs' gradients (``out<j>``, ``grad<i>``) as host arrays."""
    op = get_op(name)
    arrays = _flat(inputs)
    trainable = [
        np.issubdtype(a.dtype, np.floating) and (op.differentiable is None or i in op.differentiable)
        for i, a in enumerate(arrays)
    ]
    tensors = []
    for a, tr in zip(arrays, trainable, strict=True):
        t = dist.shard_tensor(a, mesh, [dist.Replicate()])
        t.stop_gradient = not tr
        tensors.append(t)
    out = apply(name, nest_inputs(inputs, tensors), attrs)
    outs = list(out) if op.multi_output else [out]
    saved = {f"out{j}": to_numpy(o.full_tensor()) for j, o in enumerate(outs)}
    if op.grad is None:
        return saved
    loss = None
    for o in outs:
        if np.issubdtype(o.dtype, np.floating) and not o.stop_gradient:
            cot = dist.shard_tensor(rng.standard_normal(tuple(o.shape)).astype(o.dtype), mesh, [dist.Replicate()])
            term = dist.sum(dist.multiply(o, cot))
            loss = term if loss is None else dist.add(loss, term)
    if loss is not None:
        loss.backward()
        for i, t in enumerate(tensors):
            if t.grad is not None:
                saved[f"grad{i}"] = to_numpy(t.grad.full_tensor())
    return saved


def compare(want_path: str, got_path: str, rtol: float) -> list[str]:
    """What differs between two runs' saved results: keys on one side only, errors, dtypes or
    shapes, and values (bit for bit with ``rtol`` 0, else within ``rtol`` of the data's scale;
    NaNs must match)."""
    with np.load(want_path) as want_file, np.load(got_path) as got_file:
        want, got = dict(want_file), dict(got_file)
    problems = [f"{k}: only in {want_path if k in want else got_path}" for k in sorted(set(want) ^ set(got))]
    for key in sorted(set(want) & set(got)):
        w, g = want[key], got[key]
        if key.endswith("/error"):
            problems.append(f"{key}: {g}")
        elif w.dtype != g.dtype or w.shape != g.shape:
            problems.append(f"{key}: {g.dtype}{list(g.shape)} against {w.dtype}{list(w.shape)}")
        elif rtol == 0.0 or not np.issubdtype(w.dtype, np.inexact):
            if w.tobytes() != g.tobytes():
                problems.append(f"{key}: not the same bits")
        else:
            scale = max(1.0, float(np.nanmax(np.abs(w))) if w.size and not np.all(np.isnan(w)) else 1.0)
            if not np.array_equal(np.isnan(w), np.isnan(g)) or not np.allclose(
                w, g, rtol=rtol, atol=rtol * scale, equal_nan=True
            ):
                err = float(np.nanmax(np.abs(w - g))) if w.size else 0.0
                problems.append(f"{key}: differs by up to {err:.3g} (scale {scale:.3g})")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where rank 0 saves the results (.npz)")
    parser.add_argument("--samples", type=int, default=2, help="checker samples per op")
    parser.add_argument("--compare", nargs=2, metavar=("WANT", "GOT"), help="compare two saved runs instead")
    parser.add_argument("--rtol", type=float, default=0.0, help="--compare: 0 for bit for bit")
    args = parser.parse_args()
    if args.compare:
        problems = compare(*args.compare, args.rtol)
        print("\n".join(problems) if problems else f"same: {args.compare[0]} and {args.compare[1]}")
        raise SystemExit(1 if problems else 0)
    if not args.out:
        parser.error("--out is required (or --compare WANT GOT)")
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    results: dict[str, np.ndarray] = {}
    failed = []
    for op in registered_ops():
        if op.sample is None:
            continue
        rng = np.random.default_rng(7)
        for k, (inputs, attrs) in enumerate(op.sample(rng)[: args.samples]):
            dist.seed(11)  # random ops (dropout) draw the same masks on every backend
            try:
                for key, value in run_sample(op.name, inputs, attrs, mesh, rng).items():
                    results[f"{op.name}/{k}/{key}"] = value
            except Exception as exc:  # record and go on: one run names every op that fails
                failed.append(op.name)
                results[f"{op.name}/{k}/error"] = np.array(f"{type(exc).__name__}: {exc}")
    if dist.get_rank() == 0:
        np.savez(args.out, **results)
    dist.print_once(
        f"kernels on {dist.current_backend().name}: {len(results)} arrays, "
        f"{len(failed)} failing samples{': ' + ', '.join(sorted(set(failed))) if failed else ''}"
    )


if __name__ == "__main__":
    main()
