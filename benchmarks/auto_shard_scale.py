"""``dist.auto_shard`` search time against the number of layers.

    .venv/bin/python benchmarks/auto_shard_scale.py [--max-gpt-layers 4] [--max-mlp-depth 16]

For the built-in GPT (hidden 1024, 16 heads, vocabulary 32768, sequence 1024, micro-batch 4,
no annotations) with 1, 2, 4, ... transformer layers, and for a Linear-ReLU stack (width 4096,
batch 1024) of 2, 4, 8, ... Linears, on a 1 x 2 (dp x tp) mesh priced with the default
``a100-nvlink-ib`` preset: the units searched, the DP chain steps, the shape-only traces,
the rounds, the wall seconds, seconds per trace, and the time ratio to the smallest model of
the family measured in the same process. A trace costs what the step's op count costs, so
the search grows about as (chain steps) x (ops per step): quadratic in the depth, against
the ``3**units`` of trying every combination (printed alongside).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from results import add_json_argument, record

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, gpt_loss
from mpipar.nn import Linear, ReLU, Sequential
from mpipar.tensor import Tensor


def gpt_case(layers: int) -> tuple[Any, tuple[Tensor, ...], Callable[..., Tensor]]:
    cfg = GPTConfig(vocab_size=32768, block_size=1024, n_layer=layers, n_head=16, n_embd=1024)
    idx = Tensor(np.zeros((4, 1024), dtype=np.int64))
    return GPT(cfg), (idx, idx), lambda m, x, y: gpt_loss(m(x), y)


def mlp_case(depth: int) -> tuple[Any, tuple[Tensor, ...], Callable[..., Tensor] | None]:
    layers: list[Any] = []
    for _ in range(depth):
        layers += [Linear(4096, 4096), ReLU()]
    return Sequential(*layers), (Tensor(np.zeros((1024, 4096), dtype=np.float32)),), None


def run(name: str, sizes: list[int], case: Callable[[int], tuple[Any, tuple[Tensor, ...], Any]]) -> None:
    mesh = dist.ProcessMesh(np.arange(2).reshape(1, 2), dim_names=["dp", "tp"])
    print(f"{name}:")
    print(
        f"  {'layers':>6} {'units':>5} {'chain':>5} {'traces':>6} {'rounds':>6} {'seconds':>8} {'s/trace':>8} {'ratio':>6}  3**units"
    )
    first = None
    for n in sizes:
        model, inputs, step = case(n)
        started = time.perf_counter()
        plan = dist.auto_shard(model, mesh, inputs, step=step)
        seconds = time.perf_counter() - started
        first = first or seconds
        chain = len({id(u.stage) for u in plan.units if u.stage is not None})
        rounds = sum(h.startswith("round") for h in plan.history)  # not the conventional pass's line
        print(
            f"  {n:>6} {len(plan.units):>5} {chain:>5} {plan.traces:>6} {rounds:>6} {seconds:>8.2f} "
            f"{seconds / plan.traces:>8.3f} {seconds / first:>6.2f}  {3 ** len(plan.units):.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gpt-layers", type=int, default=4)
    ap.add_argument("--max-mlp-depth", type=int, default=16)
    add_json_argument(ap)
    args = ap.parse_args()
    record(args.json, __file__)
    gpt_sizes = [n for n in (1, 2, 4, 8, 16) if n <= args.max_gpt_layers]
    mlp_sizes = [n for n in (2, 4, 8, 16, 32) if n <= args.max_mlp_depth]
    run("GPT (transformer layers)", gpt_sizes, gpt_case)
    run("Linear-ReLU stack (Linears)", mlp_sizes, mlp_case)


if __name__ == "__main__":
    main()
