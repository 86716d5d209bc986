"""The NCCL backend on however many GPUs there are: selection, CuPy shards, a reshard round trip.

    mpiexec -n <number of GPUs> python tests/mpi_scripts/nccl_smoke.py

Checks that the backend chosen automatically is ``nccl`` (CUDA is usable), that shards are
CuPy arrays on this rank's GPU, and that S(0) -> R -> P(sum) -> S(1) -> S(0) over a mesh of
every rank gives back the dense value bit for bit. Rank 0 prints ``ok nccl <n> ranks``.
"""

from __future__ import annotations

import numpy as np

import mpipar as dist
from mpipar._xp import to_numpy


def main() -> None:
    backend = dist.current_backend()
    assert backend.name == "nccl", f"expected the nccl backend to be chosen, got {backend.name}"
    world, me = dist.get_world_size(), dist.get_rank()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
    value = np.arange(7.0 * 5).reshape(7, 5)  # uneven over most world sizes
    t = dist.shard_tensor(value, mesh, [dist.Shard(0)])
    assert type(t.local_tensor(me)).__module__.startswith("cupy"), type(t.local_tensor(me))
    for placements in ([dist.Replicate()], [dist.Partial("sum")], [dist.Shard(1)], [dist.Shard(0)]):
        t = dist.reshard(t, mesh, placements)
    np.testing.assert_array_equal(to_numpy(t.full_tensor()), value)
    dist.print_once(f"ok nccl {world} ranks")


if __name__ == "__main__":
    main()
