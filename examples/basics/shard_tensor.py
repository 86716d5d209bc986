"""Seed 000 §2.2: a (4, 3) tensor on the 2x3 mesh [[2, 4, 5], [0, 1, 3]] with [Shard(0), Shard(1)].

Every rank holds a (2, 1) block. Prints each hosted rank's local shard.

    python examples/basics/shard_tensor.py                   # simulator: all 6 ranks
    python -m simulator --reference examples/basics/shard_tensor.py
    mpiexec -n 6 python examples/basics/shard_tensor.py
"""

import argparse

import numpy as np

import mpipar as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="int64", help="element type of the tensor")
    args = parser.parse_args()

    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    dense_tensor = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], dtype=args.dtype)
    placements = [dist.Shard(0), dist.Shard(1)]
    dist_tensor = dist.shard_tensor(dense_tensor, mesh, placements)

    if dist.current_backend().reference:
        print(f"one big device: {dist_tensor.full_tensor().tolist()}")
        return
    for rank in dist_tensor.hosted_ranks:
        local = dist_tensor.local_tensor(rank)
        print(f"rank {rank} coord {mesh.coordinate(rank)}: local shape {list(local.shape)} {local.tolist()}")


if __name__ == "__main__":
    main()
