"""Tensor-parallel MLP step, mpipar under MPI vs PyTorch DTensor on gloo, in one script run.

    .venv/bin/pip install -e ".[torch]"                   # torch==2.13.0 (CPU wheel)
    .venv/bin/python benchmarks/runtime_vs_torch.py [--iters 40] [--rounds 3] [--world 4] [--step train]

Two comparisons (``--step``: ``train``, ``forward-backward`` or ``both``, the default).

**The training step** (first): the TP MLP of ``tp_mlp_vs_mpi4py.py`` (batch 32, 256 -> 4096 ->
256 with biases, float32, loss ``mean(y * y)``, forward, backward and SGD with lr 0.01) three
ways: mpipar and the hand-written mpi4py Megatron MLP (one ``mpiexec -n 4`` launch, timed in
turns step by step, each checked against the other's losses and weights first), and PyTorch DTensor on
gloo (``ColwiseParallel``/``RowwiseParallel``, ``torch.optim.SGD``; its first losses checked
against the hand-written ones). Without PyTorch that column is skipped, saying so. Each round
takes the median step of each; the result is each one's best round, as a ratio to the
hand-written step.

**Forward and backward only** (needs PyTorch):

The step: batch 32, 256 -> 4096 -> 256 (Linear, ReLU, Linear, both with bias), loss = sum
of the output, forward and backward (gradients of every parameter; the input needs none),
float32, the hidden dim split over ``--world`` ranks (default 4):

======================  =============================================  ====================================================
                        mpipar (``mpiexec -n 4``, MPI backend)          PyTorch (``torch.multiprocessing`` x 4, gloo)
======================  =============================================  ====================================================
first Linear            weight ``Shard(1)``, bias ``Shard(0)``         ``ColwiseParallel()``
second Linear           weight ``Shard(0)``, bias ``Replicate()``      ``RowwiseParallel()`` (output replicated)
placed by               ``dist.shard_tensor`` on the parameters        ``parallelize_module`` on a ``DeviceMesh("cpu")``
communication           one all-reduce forward, none backward          one all-reduce forward, none backward
======================  =============================================  ====================================================

Both start from the same weights and input (NumPy, seed 0); the script checks that both
compute the step (loss and gradient norms within 1e-4 of float64 NumPy) before timing counts. This script launches both itself, in turns
(``--rounds`` of each), one process per rank, each with one BLAS/OpenMP thread per rank.
A step is timed on every rank between two barriers and the slowest rank's time counts; a
round reports the median over ``--iters`` steps (after warm-up), the result is the best round
of each. Prints ours / torch (aim: at most 1.0, ours not slower).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from results import add_json_argument, record

BATCH, IN, HIDDEN = 32, 256, 4096
TRAIN_LR = 0.01  # tp_mlp_vs_mpi4py's SGD step
RESULT = "RESULT "


def weights() -> dict[str, np.ndarray]:
    """The shared starting point, with Paddle's (in, out) weight layout."""
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((BATCH, IN), dtype=np.float32),
        "w1": rng.standard_normal((IN, HIDDEN), dtype=np.float32) / np.float32(np.sqrt(IN)),
        "b1": rng.standard_normal(HIDDEN, dtype=np.float32) * np.float32(0.1),
        "w2": rng.standard_normal((HIDDEN, IN), dtype=np.float32) / np.float32(np.sqrt(HIDDEN)),
        "b2": rng.standard_normal(IN, dtype=np.float32) * np.float32(0.1),
    }


def time_steps(
    step: Callable[[], None], barrier: Callable[[], None], slowest: Callable[[float], float], iters: int, warmup: int
) -> list[float]:
    """Per step: barrier, run, the slowest rank's seconds (every rank gets the list)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        step()
        times.append(slowest(time.perf_counter() - start))
    return times


def reference() -> np.ndarray:
    """The loss and the four gradient norms (w1, b1, w2, b2) in float64 NumPy."""
    w = {k: v.astype(np.float64) for k, v in weights().items()}
    pre = w["x"] @ w["w1"] + w["b1"]
    h = np.maximum(pre, 0)
    out = h @ w["w2"] + w["b2"]
    grad_pre = np.ones_like(out) @ w["w2"].T * (pre > 0)
    grads = [w["x"].T @ grad_pre, grad_pre.sum(0), h.T @ np.ones_like(out), np.full(IN, float(BATCH))]
    return np.array([out.sum(), *(np.linalg.norm(g) for g in grads)])


# ---------------------------------------------------------------------- mpipar worker
def run_ours(iters: int, warmup: int) -> None:
    from mpi4py import MPI

    import mpipar as dist

    backend = dist.current_backend()
    world = MPI.COMM_WORLD
    if backend.name != "mpi":
        raise SystemExit("the mpipar worker runs under mpiexec (the launcher starts it)")
    n = world.Get_size()
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["tp"])
    init = weights()

    def param(name: str, placements: list[Any]) -> Any:
        t = dist.shard_tensor(init[name], mesh, placements)
        t.stop_gradient = False
        return t

    w1, b1 = param("w1", [dist.Shard(1)]), param("b1", [dist.Shard(0)])  # column parallel
    w2, b2 = param("w2", [dist.Shard(0)]), param("b2", [dist.Replicate()])  # row parallel
    x = dist.shard_tensor(init["x"], mesh, [dist.Replicate()])
    params = [w1, b1, w2, b2]

    def forward_backward() -> Any:
        h = dist.nn.functional.relu(dist.add(dist.matmul(x, w1), b1))  # (B, HIDDEN/n) per rank
        out = dist.add(dist.matmul(h, w2), b2)  # (B, IN), partial sums on each rank
        out = dist.reshard(out, mesh, [dist.Replicate()])  # all-reduce: replicated, as RowwiseParallel's output
        loss = dist.sum(out)
        loss.backward()
        return loss

    def step() -> None:
        for p in params:
            p.clear_grad()
        forward_backward()

    with dist.CommDebugMode() as comm:
        loss = forward_backward()
    check = {
        "loss": float(loss),
        "grad_norms": [float(np.linalg.norm(p.grad.full_tensor())) for p in params],
        "comm": comm.counts(),
    }

    def slowest(seconds: float) -> float:
        return float(world.allreduce(seconds, op=MPI.MAX))  # one float: the pickle path is fine here

    times = time_steps(step, world.Barrier, slowest, iters, warmup)
    if world.Get_rank() == 0:
        print(RESULT + json.dumps({"times": times, **check}), flush=True)


# ---------------------------------------------------------------------- torch worker
def _torch_tp_mlp(world_size: int) -> tuple[Any, Any]:
    """The MLP with our initial values, Megatron-split by DTensor's Colwise/RowwiseParallel, and its input."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    init = weights()
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, IN))
    with torch.no_grad():  # torch keeps (out, in) weights
        model[0].weight.copy_(torch.from_numpy(init["w1"].T.copy()))
        model[0].bias.copy_(torch.from_numpy(init["b1"]))
        model[2].weight.copy_(torch.from_numpy(init["w2"].T.copy()))
        model[2].bias.copy_(torch.from_numpy(init["b2"]))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.from_numpy(init["x"])


def _torch_slowest(seconds: float) -> float:
    """The slowest rank's seconds (one float over gloo)."""
    import torch
    import torch.distributed as tdist

    t = torch.tensor([seconds], dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def _spawn_torch(worker: Any, world_size: int, iters: int, warmup: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world_size, port, iters, warmup), nprocs=world_size, join=True)


def _torch_rank(rank: int, world_size: int, port: int, iters: int, warmup: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, x = _torch_tp_mlp(world_size)

        def forward_backward() -> Any:
            loss = model(x).sum()
            loss.backward()
            return loss

        def step() -> None:
            model.zero_grad(set_to_none=True)
            forward_backward()

        loss = forward_backward()
        order = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]  # as ours: w1, b1, w2, b2
        norms = [float(torch.linalg.vector_norm(p.grad.full_tensor())) for p in order]

        times = time_steps(step, tdist.barrier, _torch_slowest, iters, warmup)
        if rank == 0:
            print(RESULT + json.dumps({"times": times, "loss": float(loss.detach()), "grad_norms": norms}), flush=True)
    finally:
        tdist.destroy_process_group()


def run_torch(world_size: int, iters: int, warmup: int) -> None:
    _spawn_torch(_torch_rank, world_size, iters, warmup)


# ---------------------------------------------------------------------- the training step (fwd + bwd + SGD)
def run_train_mpi(iters: int, warmup: int) -> None:
    """Under mpiexec: mpipar and the hand-written mpi4py Megatron MLP (``tp_mlp_vs_mpi4py``),
    checked against each other, then timed in turns; rank 0 prints one RESULT line."""
    from mpi4py import MPI
    from tp_mlp_vs_mpi4py import hand_written, ours, steps_in_turns

    import mpipar as dist

    world = MPI.COMM_WORLD
    if dist.current_backend().name != "mpi":
        raise SystemExit("the training worker runs under mpiexec (the launcher starts it)")
    ref_step, ref_state = hand_written(world)
    ref_losses = [ref_step() for _ in range(2)]
    our_step, our_state = ours(world)
    with dist.CommDebugMode() as comm:
        losses = [our_step() for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for k, want in ref_state().items():
        np.testing.assert_allclose(our_state()[k], want, rtol=1e-3, atol=1e-5)
    # The captured step (compile_step(capture=True)): two traced calls, checked against a fresh
    # hand-written run taking the same steps, before it is timed.
    cap_step, _ = ours(world, captured=True)
    cap_ref = hand_written(world)[0]
    np.testing.assert_allclose([cap_step() for _ in range(3)], [cap_ref() for _ in range(3)], rtol=1e-4)
    if not cap_step.compiled.captured:  # type: ignore[attr-defined]
        raise SystemExit(f"the step was not captured: {cap_step.compiled.capture_refused}")  # type: ignore[attr-defined]
    contenders = {"mpipar": our_step, "mpipar captured": cap_step, "mpi4py": hand_written(world)[0]}
    # Step by step in turns (a fresh order each turn), so load that comes and goes hits both alike.
    times = steps_in_turns(world, contenders, iters, warmup)
    if world.Get_rank() == 0:
        counts = {k: v // 2 for k, v in comm.counts().items()}
        print(RESULT + json.dumps({"times": times, "losses": ref_losses, "comm": counts}), flush=True)


def _torch_train_rank(rank: int, world_size: int, port: int, iters: int, warmup: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, x = _torch_tp_mlp(world_size)
        opt = torch.optim.SGD(model.parameters(), lr=TRAIN_LR)

        def step() -> float:
            y = model(x)
            loss = (y * y).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        losses = [step() for _ in range(2)]

        times = time_steps(step, tdist.barrier, _torch_slowest, iters, warmup)
        if rank == 0:
            print(RESULT + json.dumps({"times": times, "losses": losses}), flush=True)
    finally:
        tdist.destroy_process_group()


def run_torch_train(world_size: int, iters: int, warmup: int) -> None:
    _spawn_torch(_torch_train_rank, world_size, iters, warmup)


def train_section(args: argparse.Namespace, have_torch: bool) -> None:
    """The TP MLP training step: mpipar vs hand-written mpi4py (one launch, in turns) vs torch."""
    me = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    common = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--world", str(args.world)]
    mpi_cmd = [mpiexec, "-n", str(args.world), sys.executable, me, "--worker", "train-mpi", *common]
    torch_cmd = [sys.executable, me, "--worker", "train-torch", *common]
    print(
        f"\nTP MLP training step {BATCH}x{IN} -> {HIDDEN} -> {IN}, float32, forward+backward+SGD, loss mean(y*y), "
        f"{args.world} ranks; slowest rank per step, median of {args.iters} steps per round, best of {args.rounds} rounds"
    )
    if not have_torch:
        print("  PyTorch is not installed: the DTensor column is skipped (.venv/bin/pip install -e '.[torch]')")
    best: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    comm: dict[str, int] = {}
    for r in range(args.rounds):
        res = _launch(mpi_cmd, timeout=600)
        losses["mpi4py"] = res["losses"]
        comm = res["comm"]
        row = {name: float(np.median(t)) for name, t in res["times"].items()}
        if have_torch:
            tres = _launch(torch_cmd, timeout=600)
            losses["torch"] = tres["losses"]
            row["torch"] = float(np.median(tres["times"]))
        for name, t in row.items():
            best[name] = min(best.get(name, float("inf")), t)
        print(f"  round {r}: " + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in row.items()))
    if "torch" in losses:
        np.testing.assert_allclose(losses["torch"], losses["mpi4py"], rtol=1e-4)
        print(f"  torch's first two losses {losses['torch']} match the hand-written ones {losses['mpi4py']}")
    print(
        f"  mpipar's communication per step: {comm}; its first two steps match the hand-written ones (losses, weights)"
    )
    base = best["mpi4py"]
    for name, label in (
        ("mpipar", "mpipar"),
        ("mpipar captured", "mpipar, captured"),
        ("mpi4py", "hand-written mpi4py"),
        ("torch", "torch DTensor (gloo)"),
    ):
        if name in best:
            print(f"  {label:<22}{best[name] * 1e3:9.2f} ms/step  {best[name] / base:5.2f}x hand-written")


# ---------------------------------------------------------------------- launcher
def _launch(cmd: list[str], timeout: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or len(lines) != 1:
        raise SystemExit(
            f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[0][len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each contender, in turns")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument(
        "--step",
        choices=["both", "forward-backward", "train"],
        default="both",
        help="which step to compare (default both)",
    )
    parser.add_argument("--worker", choices=["ours", "torch", "train-mpi", "train-torch"], help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args()
    record(args.json, __file__)
    if args.worker is not None:
        {
            "ours": lambda: run_ours(args.iters, args.warmup),
            "torch": lambda: run_torch(args.world, args.iters, args.warmup),
            "train-mpi": lambda: run_train_mpi(args.iters, args.warmup),
            "train-torch": lambda: run_torch_train(args.world, args.iters, args.warmup),
        }[args.worker]()
        return
    if HIDDEN % args.world:
        raise SystemExit(f"--world {args.world} must divide the hidden size {HIDDEN}")
    try:
        import torch
    except ImportError:
        torch = None
    if args.step in ("both", "train"):
        train_section(args, torch is not None)
    if args.step == "train":
        return
    if torch is None:
        print(
            "\nPyTorch is not installed: the forward+backward comparison with DTensor is skipped "
            "(.venv/bin/pip install -e '.[torch]', torch==2.13.0 CPU)"
        )
        return
    me = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    common = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--world", str(args.world)]
    ours_cmd = [mpiexec, "-n", str(args.world), sys.executable, me, "--worker", "ours", *common]
    torch_cmd = [sys.executable, me, "--worker", "torch", *common]
    print(
        f"runtime_vs_torch: TP MLP {BATCH}x{IN} -> {HIDDEN} -> {IN}, float32, forward+backward, {args.world} ranks "
        f"on {os.cpu_count()} cores; torch {torch.__version__}; slowest rank per step, median of {args.iters} "
        f"steps per round, best of {args.rounds} rounds"
    )
    rounds: dict[str, list[float]] = {"ours": [], "torch": []}
    results: dict[str, dict[str, Any]] = {}
    for r in range(args.rounds):
        for name, cmd in (("ours", ours_cmd), ("torch", torch_cmd)):
            res = _launch(cmd, timeout=600)
            results[name] = res
            rounds[name].append(float(np.median(res["times"])))
            print(
                f"  round {r}: {name:<5} median {rounds[name][-1] * 1e3:8.2f} ms  min {min(res['times']) * 1e3:8.2f} ms"
            )
    ref = reference()
    for name, res in results.items():
        values = np.array([res["loss"], *res["grad_norms"]])
        rel = np.max(np.abs(values - ref) / np.abs(ref))
        print(
            f"{name:<5} loss {res['loss']:.6f}, gradient norms {[round(v, 3) for v in res['grad_norms']]}: "
            f"within {rel:.1e} relative of float64 NumPy"
        )
        if rel > 1e-4:
            raise SystemExit(
                f"{name} does not compute the step (relative error {rel:.1e}): the timing comparison is void"
            )
    print(f"our communication per step: {results['ours']['comm']}")
    best_ours, best_torch = min(rounds["ours"]), min(rounds["torch"])
    print(
        f"step time: ours {best_ours * 1e3:.2f} ms, torch DTensor {best_torch * 1e3:.2f} ms, "
        f"ours/torch {best_ours / best_torch:.2f}x"
    )


if __name__ == "__main__":
    main()
