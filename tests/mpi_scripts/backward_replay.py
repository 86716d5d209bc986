"""Backward replay under MPI: bit-identical to the eager backward, with the same collectives.

    mpiexec -n 4 python tests/mpi_scripts/backward_replay.py --steps 6

For each case two copies of a model start from the same values and take the same steps on the
same batches, in turns: one with backward replay off (every pass through the gradient
functions), one with it on (``mpipar.backward_replay``: recorded twice, then replayed). Every
step's loss and collectives (CommDebugMode: op, ranks, bytes, dtype, reduce), and after the
run every parameter and optimizer state, must agree bit for bit (float64). Cases: the
tensor-parallel MLP with SGD (no collective in backward), the data-parallel one with AdamW
(each gradient all-reduced in the default buckets, overlapped with the replayed kernels), and a
``Linear``/``LayerNorm``/``GELU`` block on a 2-D mesh (data x tensor parallel) with Momentum.
Each rank prints ``ok <case> replayed <passes>``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

import mpipar as dist
from mpipar import backward_replay

F = dist.nn.functional


def mlp(n: int, layout: str) -> tuple[Callable[[dist.Tensor], dist.Tensor], list[dist.Tensor], Any, Any]:
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    rng = np.random.default_rng(0)
    hidden = 8 * n
    tp = layout == "tp"
    col, row, rep = dist.Shard(1), dist.Shard(0), dist.Replicate()
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((6, hidden))), mesh, [col if tp else rep])
    b1 = dist.shard_tensor(dist.Parameter(rng.standard_normal(hidden)), mesh, [row if tp else rep])
    w2 = dist.shard_tensor(dist.Parameter(rng.standard_normal((hidden, 6))), mesh, [row if tp else rep])
    b2 = dist.shard_tensor(dist.Parameter(rng.standard_normal(6)), mesh, [rep])
    params = [w1, b1, w2, b2]
    opt = (dist.optimizer.SGD if tp else dist.optimizer.AdamW)(learning_rate=0.01, parameters=params)

    def loss(x: dist.Tensor) -> dist.Tensor:
        h = F.relu(dist.add(dist.matmul(x, w1), b1))
        z = dist.add(dist.matmul(h, w2), b2)
        return dist.mean(dist.multiply(z, z))

    def batch(rng: np.random.Generator) -> dist.Tensor:
        return dist.shard_tensor(rng.standard_normal((4 * n, 6)), mesh, [rep if tp else row])

    return loss, params, opt, batch


def block(n: int) -> tuple[Callable[[dist.Tensor], dist.Tensor], list[dist.Tensor], Any, Any]:
    mesh = dist.ProcessMesh(np.arange(n).reshape(2, n // 2).tolist(), dim_names=["dp", "mp"])
    dist.seed(3)
    with dist.nn.layer.default_dtype("float64"):
        up, down, norm = dist.nn.Linear(8, 4 * n), dist.nn.Linear(4 * n, 8), dist.nn.LayerNorm(8)
    rep = dist.Replicate()
    dist.shard_tensor(up.weight, mesh, [rep, dist.Shard(1)])
    dist.shard_tensor(up.bias, mesh, [rep, dist.Shard(0)])
    dist.shard_tensor(down.weight, mesh, [rep, dist.Shard(0)])
    dist.shard_tensor(down.bias, mesh, [rep, rep])
    dist.shard_tensor(norm.weight, mesh, [rep, rep])
    dist.shard_tensor(norm.bias, mesh, [rep, rep])
    model = dist.nn.Sequential(up, dist.nn.GELU(), down, norm)
    params = list(model.parameters())
    opt = dist.optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=params)

    def loss(x: dist.Tensor) -> dist.Tensor:
        y = model(x)
        return dist.mean(dist.multiply(dist.add(y, x), y))

    def batch(rng: np.random.Generator) -> dist.Tensor:
        return dist.shard_tensor(rng.standard_normal((4 * n, 8)), mesh, [dist.Shard(0), rep])

    return loss, params, opt, batch


def events(comm: dist.CommDebugMode) -> list[tuple[Any, ...]]:
    return [(e.op, e.ranks, e.input_nbytes, e.output_nbytes, e.dtype, e.reduce_type) for e in comm.events]


def step(loss_fn: Callable[[dist.Tensor], dist.Tensor], opt: Any, x: dist.Tensor, replay: bool) -> tuple[Any, Any]:
    """One training step with backward replay on or off: its loss and the collectives it made."""
    backward_replay.set_backward_replay(replay)
    with dist.CommDebugMode() as comm:
        loss = loss_fn(x)
        loss.backward()
        opt.step()
        opt.clear_grad()
    return loss, comm


def run_case(n: int, case: str, steps: int) -> int:
    build = (lambda: block(n)) if case == "block" else (lambda: mlp(n, case))
    eager_loss, eager_params, eager_opt, batch = build()
    loss_fn, params, opt, _ = build()
    rng = np.random.default_rng(1)
    backward_replay.backward_replay_stats(reset=True)
    for i in range(steps):
        x = batch(rng)
        (want, want_comm), (got, got_comm) = (
            step(model_loss, model_opt, x, replay)
            for model_loss, model_opt, replay in ((eager_loss, eager_opt, False), (loss_fn, opt, True))
        )
        assert events(got_comm) == events(want_comm), (case, i, got_comm.table(), want_comm.table())
        assert np.array_equal(got.full_tensor(), want.full_tensor()), (case, i)
    for a, b in zip(params, eager_params, strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor()), case
        s, t = opt._states[id(a)], eager_opt._states[id(b)]
        for name in opt.state_names:
            assert np.array_equal(s[name].full_tensor(), t[name].full_tensor()), (case, name)
    stats = backward_replay.backward_replay_stats()
    assert not stats.refused, stats
    return stats.replayed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cases", default="tp,dp,block")
    args = parser.parse_args()
    n = dist.get_world_size()
    for case in args.cases.split(","):
        replayed = run_case(n, case, args.steps)
        print(f"ok {case} replayed {replayed}", flush=True)


if __name__ == "__main__":
    main()
