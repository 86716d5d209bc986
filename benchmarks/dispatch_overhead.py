"""Dispatch overhead: a 2-layer MLP forward+backward on 8 virtual ranks vs plain NumPy.

    .venv/bin/python benchmarks/dispatch_overhead.py [--hidden 1024] [--tokens 512]

The MLP is hidden -> 4*hidden -> hidden with relu and a mean loss. Two NumPy baselines run in
the same process:

* **dense**: the same arithmetic (forward, backward, the same gradients) on whole arrays, the
  one big device;
* **per-rank**: the same 8-rank computation written by hand in NumPy: every rank's local GEMMs
  on its own shards and the gradient (data parallel) or activation (tensor parallel) sums in
  rank order, with no framework. Splitting a GEMM eight ways costs time by itself (a data-
  parallel weight gradient contracts over 64 tokens per rank instead of 512, about half the
  speed per FLOP here), so this is the baseline that isolates what dispatch, rules, reshard
  planning and autograd add.

Each mpipar step also runs replayed (``dist.compile_step``: the decisions of the first step
handed back by position), taking turns with the eager step. Prints both ratios for data parallel (batch split over 8 ranks, gradient all-reduce) and
tensor parallel (column then row parallel) -- target at most 1.5x at hidden 1024 -- and the
per-op dispatch overhead in microseconds (a tiny add on 8 ranks vs a tiny NumPy add).
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


def ordered_sum(parts: list[np.ndarray]) -> np.ndarray:
    """Sum in rank order, as an ordered all-reduce does (one accumulator, no temporaries)."""
    out = parts[0].copy()
    for p in parts[1:]:
        np.add(out, p, out=out)
    return out


def numpy_data_parallel(x: np.ndarray, w0: np.ndarray, w1: np.ndarray, ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """``numpy_step`` as 8 data-parallel ranks compute it: local batch rows, summed gradients."""
    rows = np.array_split(np.arange(x.shape[0]), ranks)
    scale = np.float32(1.0 / (x.shape[0] * w1.shape[1]))
    dw0s, dw1s = [], []
    for r in rows:
        xr = x[r[0] : r[-1] + 1]
        h = xr @ w0
        a = np.maximum(h, 0)
        z = a @ w1
        dz = np.full_like(z, scale)
        da = dz @ w1.T
        dw1s.append(a.T @ dz)
        dw0s.append(xr.T @ (da * (h > 0)))
    return ordered_sum(dw0s), ordered_sum(dw1s)


def numpy_tensor_parallel(x: np.ndarray, w0: np.ndarray, w1: np.ndarray, ranks: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``numpy_step`` as 8 tensor-parallel ranks compute it (Megatron's MLP): column-parallel
    ``w0``, row-parallel ``w1``, the output summed over ranks; gradients stay sharded."""
    cols = np.array_split(np.arange(w0.shape[1]), ranks)
    w0s = [w0[:, c[0] : c[-1] + 1] for c in cols]
    w1s = [w1[c[0] : c[-1] + 1] for c in cols]
    hs = [x @ w for w in w0s]
    acts = [np.maximum(h, 0) for h in hs]
    z = ordered_sum([a @ w for a, w in zip(acts, w1s, strict=True)])
    dz = np.full_like(z, 1.0 / z.size)
    dw1s = [a.T @ dz for a in acts]
    dw0s = [x.T @ ((dz @ w.T) * (h > 0)) for w, h in zip(w1s, hs, strict=True)]
    return dw0s, dw1s


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
    print(f"MLP {H} -> {4 * H} -> {H}, {T} tokens, float32; dense NumPy forward+backward: {base * 1e3:.1f} ms")
    dw0, dw1 = numpy_step(x_np, w0_np, w1_np)
    dp0, dp1 = numpy_data_parallel(x_np, w0_np, w1_np, 8)
    tp0, tp1 = numpy_tensor_parallel(x_np, w0_np, w1_np, 8)
    for got, want in ((dp0, dw0), (dp1, dw1), (np.concatenate(tp0, axis=1), dw0), (np.concatenate(tp1, axis=0), dw1)):
        assert np.allclose(got, want, rtol=1e-3, atol=1e-6), "a per-rank NumPy baseline computes other gradients"

    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    layouts = {
        "data parallel (8)": ([dist.Shard(0)], [dist.Replicate()], [dist.Replicate()], numpy_data_parallel),
        "tensor parallel (8)": ([dist.Replicate()], [dist.Shard(1)], [dist.Shard(0)], numpy_tensor_parallel),
    }
    print(f"  {'layout':22s} {'mpipar':>9s} {'replayed':>9s} {'per-rank NumPy':>15s} {'vs per-rank':>12s} "
          f"{'vs dense':>9s} {'replayed vs dense':>18s}")
    replayed_step = dist.compile_step(mpipar_step)
    for name, (px, p0, p1, by_hand) in layouts.items():
        x = dist.shard_tensor(x_np, mesh, px)
        w0 = dist.shard_tensor(dist.Parameter(w0_np), mesh, p0)
        w1 = dist.shard_tensor(dist.Parameter(w1_np), mesh, p1)
        mpipar_step(x, w0, w1)  # warm the rule and plan caches
        replayed_step(x, w0, w1)  # record the step's decisions
        # Eager and replayed steps take turns, so that both see the same machine load.
        t, t_rep = float("inf"), float("inf")
        for _ in range(args.repeat):
            t = min(t, best_of(lambda x=x, w0=w0, w1=w1: mpipar_step(x, w0, w1), 1))
            t_rep = min(t_rep, best_of(lambda x=x, w0=w0, w1=w1: replayed_step(x, w0, w1), 1))
        t_hand = best_of(lambda f=by_hand: f(x_np, w0_np, w1_np, 8), args.repeat)
        assert np.allclose(w0.grad.full_tensor(), dw0, rtol=1e-3, atol=1e-6)
        assert np.allclose(w1.grad.full_tensor(), dw1, rtol=1e-3, atol=1e-6)
        print(
            f"  {name:22s} {t * 1e3:6.1f} ms {t_rep * 1e3:6.1f} ms {t_hand * 1e3:12.1f} ms {t / t_hand:11.2f}x "
            f"{t / base:8.2f}x {t_rep / base:17.2f}x"
        )
    print("  (target: at most 1.5x; the per-rank column is the same 8-rank arithmetic without the framework)")

    a = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    an, bn = np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)
    n = 2000
    t_op = best_of(lambda: [dist.add(a, b) for _ in range(n)], 3) / n
    t_np = best_of(lambda: [an + bn for _ in range(n)], 3) / n
    adds = dist.compile_step(lambda: [dist.add(a, b) for _ in range(n)])
    adds()
    t_rep = best_of(adds, 3) / n
    print(f"per-op dispatch: {t_op * 1e6:.1f} us for an add on 8 ranks, {t_rep * 1e6:.1f} us replayed (NumPy add of "
          f"one shard: {t_np * 1e6:.2f} us; overhead {(t_op - 8 * t_np) * 1e6:.1f} us per op, "
          f"{(t_rep - 8 * t_np) * 1e6:.1f} us replayed)")


if __name__ == "__main__":
    main()
