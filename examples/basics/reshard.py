"""Seed 000 §2.3: Replicate on mesh [0, 1] resharded to Shard(0) on mesh [2, 3].

Prints each hosted rank's local shard before and after.

    python examples/basics/reshard.py
    python -m simulator -n 4 examples/basics/reshard.py
    python -m simulator --reference examples/basics/reshard.py
    mpiexec -n 4 python examples/basics/reshard.py
"""

import argparse

import numpy as np

import mpipar as dist


def show(label: str, t: dist.Tensor) -> None:
    if dist.current_backend().reference:
        print(f"{label}: one big device: {t.full_tensor().tolist()}")
        return
    for rank in t.hosted_ranks:
        print(f"{label}: rank {rank}: {t.local_tensor(rank).tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int64", help="element type of the tensor")
    args = parser.parse_args()

    mesh0 = dist.ProcessMesh([0, 1], dim_names=["x"])
    mesh1 = dist.ProcessMesh([2, 3], dim_names=["x"])
    dense_tensor = np.array([[1, 2, 3], [4, 5, 6]], dtype=args.dtype)

    placements0 = [dist.Replicate()]
    placements1 = [dist.Shard(0)]

    dist_tensor = dist.shard_tensor(dense_tensor, mesh0, placements0)
    show("before", dist_tensor)
    dist_tensor_after_reshard = dist.reshard(dist_tensor, mesh1, placements1)
    show("after", dist_tensor_after_reshard)


if __name__ == "__main__":
    main()
