"""Framework overhead of one training step: eager vs replayed vs captured, on data too small to compute.

    .venv/bin/python benchmarks/replay_overhead.py [--steps 400]

The TP MLP step of ``tp_mlp_vs_mpi4py.py`` (Linear with bias, ReLU, Linear with bias, loss
``mean(z * z)``, backward, SGD; first weight ``Shard(1)``, second ``Shard(0)``) and its data-
parallel twin (batch ``Shard(0)``, weights replicated), on 4 virtual ranks with a batch of 4 and
widths 8 -> 16 -> 8: the arithmetic takes microseconds, so a step's time is what dispatch,
rules, reshard planning, autograd and the optimizer add. Eager, replayed
(``dist.compile_step``) and captured (``compile_step(capture=True)``) steps take turns; each is timed alone and the minimum over ``--steps``
is kept (the shared machine's load inflates the others). Run it on two versions of mpipar to
compare them (without ``compile_step`` it times the eager step only).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from results import add_json_argument, record
from tp_mlp import sgd_step, sgd_step_tensor

import mpipar as dist
from simulator import SimBackend


def make_step(layout: str, captured: bool = False) -> Callable[[], float]:
    """The step; ``captured``: through ``compile_step(capture=True)``, the loss made a float by
    the caller (the same work as the eager step's ``float(loss.full_tensor())``)."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    rng = np.random.default_rng(0)
    tp = layout == "tp"
    r, s0, s1 = dist.Replicate(), dist.Shard(0), dist.Shard(1)
    x = dist.shard_tensor(rng.standard_normal((4, 8)).astype(np.float32), mesh, [r if tp else s0])
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((8, 16)).astype(np.float32)), mesh, [s1 if tp else r])
    b1 = dist.shard_tensor(dist.Parameter(rng.standard_normal(16).astype(np.float32)), mesh, [s0 if tp else r])
    w2 = dist.shard_tensor(dist.Parameter(rng.standard_normal((16, 8)).astype(np.float32)), mesh, [s0 if tp else r])
    b2 = dist.shard_tensor(dist.Parameter(rng.standard_normal(8).astype(np.float32)), mesh, [r])
    opt = dist.optimizer.SGD(learning_rate=0.01, parameters=[w1, b1, w2, b2])
    if captured:
        program = dist.compile_step(sgd_step_tensor(x, w1, b1, w2, b2, opt), capture=True)
        return lambda: float(program())
    return sgd_step(x, w1, b1, w2, b2, opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    dist.set_backend(SimBackend(4))
    compile_step = getattr(dist, "compile_step", None)
    print(f"one training step on 4 virtual ranks, tiny data; minimum over {args.steps} steps")
    for layout in ("tp", "dp"):
        variants = {"eager": make_step(layout)}
        if compile_step is not None:
            variants["replayed"] = compile_step(make_step(layout))
            variants["captured"] = make_step(layout, captured=True)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(3):
            for fn in variants.values():
                fn()
        for _ in range(args.steps):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        cols = "  ".join(f"{name} {t * 1e6:7.0f} us" for name, t in best.items())
        ratio = "".join(
            f"  {name}/eager {best[name] / best['eager']:.2f}" for name in ("replayed", "captured") if name in best
        )
        print(f"  {layout}: {cols}{ratio}")


if __name__ == "__main__":
    main()
