"""Dispatch overhead: a 2-layer MLP forward+backward on 8 virtual ranks vs plain NumPy.

    .venv/bin/python benchmarks/dispatch_overhead.py [--hidden 1024] [--tokens 512]

The MLP is hidden -> 4*hidden -> hidden with relu and a mean loss; the NumPy baseline does the
same arithmetic (forward, backward, the same gradients) on whole arrays in the same run. Prints
the ratio for data parallel (batch split over 8 ranks, gradient all-reduce) and tensor parallel
(column then row parallel, one all-reduce each way) -- target at most 1.5x at hidden 1024 --
and the per-op dispatch overhead in microseconds (a tiny add on 8 ranks vs a tiny NumPy add).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import mpipar as dist
from simulator import SimBackend

F = dist.nn.functional


def best_of(fn: Callable[[], object], repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def numpy_step(x: np.ndarray, w0: np.ndarray, w1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = x @ w0
    a = np.maximum(h, 0)
    z = a @ w1
    dz = np.full_like(z, 1.0 / z.size)
    da = dz @ w1.T
    dw1 = a.T @ dz
    dh = da * (h > 0)
    dw0 = x.T @ dh
    return dw0, dw1


def mpipar_step(x: dist.Tensor, w0: dist.Tensor, w1: dist.Tensor) -> None:
    w0.clear_grad()
    w1.clear_grad()
    loss = dist.mean(dist.matmul(F.relu(dist.matmul(x, w0)), w1))
    loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    dist.set_backend(SimBackend(8))
    rng = np.random.default_rng(0)
    H, T = args.hidden, args.tokens
    x_np = rng.standard_normal((T, H)).astype(np.float32)
    w0_np = (rng.standard_normal((H, 4 * H)) / np.sqrt(H)).astype(np.float32)
    w1_np = (rng.standard_normal((4 * H, H)) / np.sqrt(4 * H)).astype(np.float32)
    base = best_of(lambda: numpy_step(x_np, w0_np, w1_np), args.repeat)
    print(f"MLP {H} -> {4 * H} -> {H}, {T} tokens, float32; NumPy forward+backward: {base * 1e3:.1f} ms")

    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    layouts = {
        "data parallel (8)": ([dist.Shard(0)], [dist.Replicate()], [dist.Replicate()]),
        "tensor parallel (8)": ([dist.Replicate()], [dist.Shard(1)], [dist.Shard(0)]),
    }
    for name, (px, p0, p1) in layouts.items():
        x = dist.shard_tensor(x_np, mesh, px)
        w0 = dist.shard_tensor(dist.Parameter(w0_np), mesh, p0)
        w1 = dist.shard_tensor(dist.Parameter(w1_np), mesh, p1)
        mpipar_step(x, w0, w1)  # warm the rule and plan caches
        t = best_of(lambda x=x, w0=w0, w1=w1: mpipar_step(x, w0, w1), args.repeat)
        dw0, dw1 = numpy_step(x_np, w0_np, w1_np)
        assert np.allclose(w0.grad.full_tensor(), dw0, rtol=1e-3, atol=1e-6)
        assert np.allclose(w1.grad.full_tensor(), dw1, rtol=1e-3, atol=1e-6)
        print(f"  {name:22s} {t * 1e3:8.1f} ms   ratio {t / base:5.2f}  (target <= 1.5)")

    a = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    an, bn = np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)
    n = 2000
    t_op = best_of(lambda: [dist.add(a, b) for _ in range(n)], 3) / n
    t_np = best_of(lambda: [an + bn for _ in range(n)], 3) / n
    print(f"per-op dispatch: {t_op * 1e6:.1f} us for an add on 8 ranks (NumPy add of one shard: {t_np * 1e6:.2f} us; "
          f"overhead {(t_op - 8 * t_np) * 1e6:.1f} us per op)")


if __name__ == "__main__":
    main()
