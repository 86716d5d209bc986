"""``dist.auto_shard`` under MPI: every process searches, all agree, and training matches one device.

    mpiexec -n 2 python tests/mpi_scripts/auto_shard_mlp.py

Each process runs the same shape-only search (no communication: the simulator's shape-only
backend inside each process), lays a Linear-ReLU stack out with the result and trains three
SGD steps on a ``tp`` mesh of all ranks; the per-process choices are all-gathered and must
agree, and the losses must equal, bit for bit, those of the same steps on one device (the
reference backend, in-process). Rank 0 prints ``ok <choices> <losses>``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpipar as dist
from mpipar.autoshard import AutoShard
from mpipar.nn import Linear, ReLU, Sequential
from simulator import ReferenceBackend

WIDTH = 512


def mlp() -> Sequential:
    return Sequential(Linear(WIDTH, WIDTH), ReLU(), Linear(WIDTH, WIDTH), ReLU())


def losses(mesh: dist.ProcessMesh, plan: AutoShard, x: np.ndarray) -> list[float]:
    dist.seed(0)
    model = mlp()
    dist.shard_layer(model, mesh, plan)
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    out = []
    for _ in range(3):
        loss = dist.mean(dist.square(model(dist.shard_tensor(x, mesh, [dist.Replicate()]))))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss.full_tensor()))
    return out


def main() -> None:
    n = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["tp"])
    x = np.random.default_rng(0).standard_normal((256, WIDTH))
    plan = dist.auto_shard(mlp(), mesh, (dist.Tensor(x),))
    mine = ",".join(f"{k}={v}" for k, v in sorted(plan.choices.items()))
    everyone = MPI.COMM_WORLD.allgather(mine)  # the processes' own answers, outside mpipar
    assert all(c == mine for c in everyone), f"processes chose differently: {everyone}"
    got = losses(mesh, plan, x)
    with dist.use_backend(ReferenceBackend()):
        want = losses(mesh, plan, x)
    assert got == want, f"rank {dist.get_rank()}: {got} != one device {want}"
    if dist.get_rank() == 0:
        print(f"ok {mine} {got}")


if __name__ == "__main__":
    main()
