"""Dispatch overhead: a 2-layer MLP forward+backward on 8 virtual ranks vs plain NumPy.

    .venv/bin/python benchmarks/dispatch_overhead.py [--hidden 1024] [--tokens 512] [--rounds 3] [--turns 7]
        [--layout data|tensor|both] [--breakdown] [--glibc-malloc-defaults] [--clock wall|cpu]

Run it with ``OPENBLAS_NUM_THREADS=1`` for ratios that hold still on a shared machine: with
BLAS threads on 2 cores that other jobs also use, a GEMM's time follows the load.

The MLP is hidden -> 4*hidden -> hidden with relu and a mean loss. Two NumPy baselines run in
the same process:

* **dense**: the same arithmetic (forward, backward, the same gradients) on whole arrays, the
  one big device;
* **per-rank**: the same 8-rank computation written by hand in NumPy: every rank's local GEMMs
  on its own shards and the gradient (data parallel) or activation (tensor parallel) sums in
  rank order, with no framework. Splitting a GEMM eight ways costs time by itself (a data-
  parallel weight gradient contracts over 64 tokens per rank instead of 512, about half the
  speed per FLOP here). In the data-parallel layout mpipar's simulator does less than this
  and gets the same bits (``mpipar.ops.stacked_gemm``: one GEMM on the ranks' stacked rows
  where they share the weight, and the weight gradients' rank-ordered sum a tile at a time
  without writing the eight products), so it runs below 1x of it; ``MPIPAR_STACK_GEMMS=0``
  turns that off, and then this baseline isolates what dispatch, rules, reshard planning and
  autograd add.

Each mpipar step also runs replayed (``dist.compile_step``: the decisions of the first step
handed back by position). The four variants (dense, per-rank, eager, replayed) take turns: each
turn runs every one once in a fresh random order, so machine drift (this machine is shared)
hits all alike. A ratio is the median over turns of the two variants' times in the same turn;
each round prints every variant's median time and these ratios, and the summary the best round
median per variant and each ratio over all turns, with the rounds' lowest and highest. Layouts:
data parallel (batch split over 8 ranks, gradient all-reduce; targets at most 1.3x dense, 1.5x
per-rank) and tensor parallel (column then row parallel). Last, the per-op dispatch overhead in microseconds
(a tiny add on 8 ranks vs a tiny NumPy add).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from results import add_json_argument, record

import mpipar as dist
from mpipar.comm import reduce_arrays
from mpipar.ops import stacked_gemm
from simulator import SimBackend

F = dist.nn.functional


def best_of(fn: Callable[[], object], repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def take_turns(
    variants: dict[str, Callable[[], object]],
    turns: int,
    rng: np.random.Generator,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Each variant's seconds in each of ``turns`` turns; every turn runs each variant once, in a
    fresh random order, so that a change of machine load lands on all of them alike (timing
    them apart makes their ratio mostly the load's drift)."""
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for fn in variants.values():  # untimed: first calls fault in their arrays' pages
        fn()
    for _ in range(turns):
        for i in rng.permutation(len(names)):
            t0 = clock()
            variants[names[i]]()
            times[names[i]].append(clock() - t0)
    return times


def median(xs: list[float]) -> float:
    return float(np.median(xs))


def turn_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """The median over turns of ``num``'s time over ``den``'s in the same turn: a ratio of two
    runs seconds apart, which load that drifts over the round moves less than their medians."""
    return median([n / d for n, d in zip(times[num], times[den], strict=True)])


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


def numpy_tensor_parallel(
    x: np.ndarray, w0: np.ndarray, w1: np.ndarray, ranks: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
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


def data_parallel_breakdown(
    x: np.ndarray,
    w0: np.ndarray,
    w1: np.ndarray,
    ranks: int,
    turns: int,
    rng: np.random.Generator,
    clock: Callable[[], float],
) -> None:
    """Where the data-parallel step's time goes beyond dense: each piece of ``numpy_step`` once on
    whole arrays and once as ``ranks`` per-rank pieces (plus the ordered sum of the weight
    gradients, by ``mpipar.comm.reduce_arrays`` as the simulator sums them), taking turns.
    Then what mpipar's step does instead (``mpipar.ops.stacked_gemm``), each against the
    per-rank way and checked bit for bit here too: the row-split GEMMs as one GEMM on the
    stacked rows, and each weight gradient's rank-ordered sum a tile at a time, without
    writing the eight products."""
    rows = [slice(r[0], r[-1] + 1) for r in np.array_split(np.arange(x.shape[0]), ranks)]
    h = x @ w0  # (T, 4H)
    a = np.maximum(h, 0)
    dz = np.full((x.shape[0], w1.shape[1]), np.float32(1.0 / (x.shape[0] * w1.shape[1])))
    da = dz @ w1.T
    dh = da * (h > 0)
    dw1s = [a[r].T @ dz[r] for r in rows]
    dw0s = [x[r].T @ dh[r] for r in rows]
    pieces: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "x @ w0 (forward)": (lambda: x @ w0, lambda: [x[r] @ w0 for r in rows]),
        "a @ w1 (forward)": (lambda: a @ w1, lambda: [a[r] @ w1 for r in rows]),
        "dz @ w1.T (input grad)": (lambda: dz @ w1.T, lambda: [dz[r] @ w1.T for r in rows]),
        "a.T @ dz (weight grad)": (lambda: a.T @ dz, lambda: [a[r].T @ dz[r] for r in rows]),
        "x.T @ dh (weight grad)": (lambda: x.T @ dh, lambda: [x[r].T @ dh[r] for r in rows]),
        "relu and its backward": (
            lambda: (np.maximum(h, 0), da * (h > 0)),
            lambda: [(np.maximum(h[r], 0), da[r] * (h[r] > 0)) for r in rows],
        ),
        "ordered sum of 8 grads x2": (lambda: None, lambda: (reduce_arrays(dw1s, "sum"), reduce_arrays(dw0s, "sum"))),
    }
    print(f"data-parallel breakdown, {ranks} ranks, median of {turns} turns (ms): piece, dense, per-rank, extra")
    tot_d = tot_r = 0.0
    for name, (dense, per_rank) in pieces.items():
        med = {k: median(v) for k, v in take_turns({"dense": dense, "ranks": per_rank}, turns, rng, clock).items()}
        tot_d += med["dense"]
        tot_r += med["ranks"]
        print(
            f"  {name:28s} {med['dense'] * 1e3:7.1f} {med['ranks'] * 1e3:7.1f} {(med['ranks'] - med['dense']) * 1e3:+7.1f}"
        )
    print(
        f"  {'total':28s} {tot_d * 1e3:7.1f} {tot_r * 1e3:7.1f} {(tot_r - tot_d) * 1e3:+7.1f}  ({tot_r / tot_d:.2f}x)"
    )
    for name, (lhs, rhs) in {"x @ w0": (x, w0), "a @ w1": (a, w1), "dz @ w1.T": (dz, w1.T)}.items():
        same = np.array_equal(lhs @ rhs, np.concatenate([lhs[r] @ rhs for r in rows]))
        variants = {
            "stacked": lambda lhs=lhs, rhs=rhs: lhs @ rhs,
            "ranks": lambda lhs=lhs, rhs=rhs: [lhs[r] @ rhs for r in rows],
        }
        med = {k: median(v) for k, v in take_turns(variants, turns, rng, clock).items()}
        print(
            f"  {name}: one stacked GEMM {med['stacked'] * 1e3:.1f} ms against {med['ranks'] * 1e3:.1f} ms per rank; "
            f"bit for bit the per-rank result on this BLAS: {same}"
        )
    for name, (lhs, rhs) in {"a.T @ dz": (a, dz), "x.T @ dh": (x, dh)}.items():
        pairs = [(lhs[r], rhs[r]) for r in rows]
        summed = stacked_gemm.product_sum(pairs, True, False, lhs.dtype)  # what mpipar's data-parallel step does
        same = summed is not None and np.array_equal(summed, reduce_arrays([lhs[r].T @ rhs[r] for r in rows], "sum"))
        variants = {
            "tiled": lambda p=pairs, d=lhs.dtype: stacked_gemm.product_sum(p, True, False, d),
            "written": lambda lhs=lhs, rhs=rhs: reduce_arrays([lhs[r].T @ rhs[r] for r in rows], "sum"),
        }
        med = {k: median(v) for k, v in take_turns(variants, turns, rng, clock).items()}
        print(
            f"  {name} summed over ranks: tile by tile {med['tiled'] * 1e3:.1f} ms against {med['written'] * 1e3:.1f} ms "
            f"written and summed; bit for bit the rank-ordered sum on this BLAS: {same}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each prints its own medians and ratios")
    parser.add_argument("--turns", type=int, default=7, help="turns per round; each runs every variant once")
    parser.add_argument("--layout", choices=["data", "tensor", "both"], default="both")
    parser.add_argument("--breakdown", action="store_true", help="also time the data-parallel step piece by piece")
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="SimBackend(reuse_freed_memory=False): freed memory goes back to the system as glibc decides",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (time.process_time), which time spent waiting for a "
        "core does not inflate; with one BLAS thread the same work as wall time on an idle machine",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    for flag, value, low in (
        ("--rounds", args.rounds, 1),
        ("--turns", args.turns, 1),
        ("--hidden", args.hidden, 8),
        ("--tokens", args.tokens, 8),
    ):
        if value < low:
            parser.error(
                f"{flag} must be at least {low} (8 ranks split it), got {value}"
                if low == 8
                else f"{flag} must be at least 1, got {value}"
            )
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    dist.set_backend(SimBackend(8, reuse_freed_memory=not args.glibc_malloc_defaults))
    rng = np.random.default_rng(0)
    H, T = args.hidden, args.tokens
    x_np = rng.standard_normal((T, H)).astype(np.float32)
    w0_np = (rng.standard_normal((H, 4 * H)) / np.sqrt(H)).astype(np.float32)
    w1_np = (rng.standard_normal((4 * H, H)) / np.sqrt(4 * H)).astype(np.float32)
    print(f"MLP {H} -> {4 * H} -> {H}, {T} tokens, float32, forward+backward; {args.clock} clock")
    dw0, dw1 = numpy_step(x_np, w0_np, w1_np)
    dp0, dp1 = numpy_data_parallel(x_np, w0_np, w1_np, 8)
    tp0, tp1 = numpy_tensor_parallel(x_np, w0_np, w1_np, 8)
    for got, want in ((dp0, dw0), (dp1, dw1), (np.concatenate(tp0, axis=1), dw0), (np.concatenate(tp1, axis=0), dw1)):
        assert np.allclose(got, want, rtol=1e-3, atol=1e-6), "a per-rank NumPy baseline computes other gradients"

    if args.breakdown:
        data_parallel_breakdown(x_np, w0_np, w1_np, 8, args.turns, np.random.default_rng(2), clock)
    mesh = dist.ProcessMesh(list(range(8)), dim_names=["x"])
    layouts = {
        "data parallel (8)": ([dist.Shard(0)], [dist.Replicate()], [dist.Replicate()], numpy_data_parallel),
        "tensor parallel (8)": ([dist.Replicate()], [dist.Shard(1)], [dist.Shard(0)], numpy_tensor_parallel),
    }
    if args.layout != "both":
        layouts = {k: v for k, v in layouts.items() if k.startswith(args.layout)}
    replayed_step = dist.compile_step(mpipar_step)
    order_rng = np.random.default_rng(1)
    summary = []
    for name, (px, p0, p1, by_hand) in layouts.items():
        x = dist.shard_tensor(x_np, mesh, px)
        w0 = dist.shard_tensor(dist.Parameter(w0_np), mesh, p0)
        w1 = dist.shard_tensor(dist.Parameter(w1_np), mesh, p1)
        mpipar_step(x, w0, w1)  # warm the rule and plan caches
        replayed_step(x, w0, w1)  # record the step's decisions
        variants: dict[str, Callable[[], object]] = {
            "dense": lambda: numpy_step(x_np, w0_np, w1_np),
            "per-rank": lambda f=by_hand: f(x_np, w0_np, w1_np, 8),
            "eager": lambda x=x, w0=w0, w1=w1: mpipar_step(x, w0, w1),
            "replayed": lambda x=x, w0=w0, w1=w1: replayed_step(x, w0, w1),
        }
        print(f"{name}: {args.rounds} rounds of {args.turns} turns, each turn every variant once in a fresh order")
        pairs = {
            "eager/dense": ("eager", "dense"),
            "replayed/dense": ("replayed", "dense"),
            "eager/per-rank": ("eager", "per-rank"),
        }
        rounds = [take_turns(variants, args.turns, order_rng, clock) for _ in range(args.rounds)]
        for i, times in enumerate(rounds):
            med = {v: median(ts) for v, ts in times.items()}
            print(
                f"  round {i + 1}: "
                + ", ".join(f"{v} {med[v] * 1e3:6.1f} ms" for v in variants)
                + "; "
                + ", ".join(f"{k} {turn_ratio(times, a, b):.2f}x" for k, (a, b) in pairs.items())
            )
        assert np.allclose(w0.grad.full_tensor(), dw0, rtol=1e-3, atol=1e-6)
        assert np.allclose(w1.grad.full_tensor(), dw1, rtol=1e-3, atol=1e-6)
        best = {v: min(median(times[v]) for times in rounds) for v in variants}
        everything = {v: [t for times in rounds for t in times[v]] for v in variants}
        ratios = {
            k: (turn_ratio(everything, a, b), sorted(turn_ratio(times, a, b) for times in rounds))
            for k, (a, b) in pairs.items()
        }
        summary.append((name, best, ratios))
    print(
        f"  {'layout':22s} {'dense':>9s} {'per-rank':>9s} {'mpipar':>9s} {'replayed':>9s}   "
        "per-turn ratios: median over all turns (rounds' lowest-highest)"
    )
    for name, best, ratios in summary:
        spread = "  ".join(f"{k} {all_turns:.2f}x ({r[0]:.2f}-{r[-1]:.2f})" for k, (all_turns, r) in ratios.items())
        print(
            f"  {name:22s} {best['dense'] * 1e3:6.1f} ms {best['per-rank'] * 1e3:6.1f} ms {best['eager'] * 1e3:6.1f} ms "
            f"{best['replayed'] * 1e3:6.1f} ms   {spread}"
        )
    print(
        "  (the times: best of the rounds' medians; targets: data parallel at most 1.3x dense, at most 1.5x per-rank)"
    )

    a = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    b = dist.shard_tensor(np.ones((8, 4), np.float32), mesh, [dist.Shard(0)])
    an, bn = np.ones((1, 4), np.float32), np.ones((1, 4), np.float32)
    n = 2000
    t_op = best_of(lambda: [dist.add(a, b) for _ in range(n)], 3) / n
    t_np = best_of(lambda: [an + bn for _ in range(n)], 3) / n
    adds = dist.compile_step(lambda: [dist.add(a, b) for _ in range(n)])
    adds()
    t_rep = best_of(adds, 3) / n
    print(
        f"per-op dispatch: {t_op * 1e6:.1f} us for an add on 8 ranks, {t_rep * 1e6:.1f} us replayed (NumPy add of "
        f"one shard: {t_np * 1e6:.2f} us; overhead {(t_op - 8 * t_np) * 1e6:.1f} us per op, "
        f"{(t_rep - 8 * t_np) * 1e6:.1f} us replayed)"
    )


if __name__ == "__main__":
    main()
