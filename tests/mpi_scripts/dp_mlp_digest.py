"""A data-parallel MLP's gradients and loss as a digest: the simulator's shortcuts give MPI's bits.

    mpiexec -n 4 python tests/mpi_scripts/dp_mlp_digest.py

Shapes large enough for the simulator to stack the ranks' GEMMs and to sum the weight
gradients a tile at a time (``mpipar.ops.stacked_gemm``): 512 tokens over the ranks, hidden
256, float32 and float64. Under MPI each rank computes its own rows; rank 0 prints one line
per dtype, ``digest <dtype> <hex>``. ``digests`` is imported by ``tests/unit/test_stacked_gemm.py``
to compute the same in the simulator.
"""

from __future__ import annotations

import hashlib

import numpy as np

import mpipar as dist

F = dist.nn.functional
TOKENS, HIDDEN = 512, 256


def digests(ranks: int) -> dict[str, str]:
    """Per dtype: sha256 (16 hex digits) of the loss and both weight gradients after a step."""
    mesh = dist.ProcessMesh(list(range(ranks)), dim_names=["dp"])
    out = {}
    for dtype in (np.float32, np.float64):
        rng = np.random.default_rng(11)
        x = dist.shard_tensor(rng.standard_normal((TOKENS, HIDDEN)).astype(dtype), mesh, [dist.Shard(0)])
        w0 = dist.shard_tensor(
            dist.Parameter((rng.standard_normal((HIDDEN, 4 * HIDDEN)) / 16).astype(dtype)), mesh, [dist.Replicate()]
        )
        w1 = dist.shard_tensor(
            dist.Parameter((rng.standard_normal((4 * HIDDEN, HIDDEN)) / 32).astype(dtype)), mesh, [dist.Replicate()]
        )
        loss = dist.mean(dist.matmul(F.relu(dist.matmul(x, w0)), w1) ** 2)
        loss.backward()
        h = hashlib.sha256(np.asarray(float(loss)).tobytes())
        for g in (w0.grad, w1.grad):
            h.update(np.ascontiguousarray(g.full_tensor()).tobytes())
        out[np.dtype(dtype).name] = h.hexdigest()[:16]
    return out


def main() -> None:
    found = digests(dist.get_world_size())
    if dist.get_rank() == 0:
        for name, value in found.items():
            print(f"digest {name} {value}", flush=True)


if __name__ == "__main__":
    main()
