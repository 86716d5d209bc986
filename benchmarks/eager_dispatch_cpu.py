"""The eager step's Python work per step on one rank: the TP MLP step of ``tp_mlp_vs_mpi4py.py``
as rank 0 of ``mpiexec -n 4`` runs it, in one process, without MPI.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/eager_dispatch_cpu.py [--steps 300] [--rounds 7] [--hidden 16]

(One BLAS thread: process CPU time counts every thread, and BLAS threads waiting for a core
on a shared machine add time that is neither the kernels nor dispatch.)

A backend hosting rank 0 of each mesh only (dispatch's one-rank path, the one every op takes
under MPI) runs the public-API step (Linear with bias, ReLU, Linear with bias, ``mean(z * z)``,
backward, SGD; the hidden dim split over 4 ranks), with the one all-reduce a local stand-in:
what is left is the framework's own work, which every rank pays on every step. Reported per
step, with the default sums, agreement check and gradient buckets:

* **CPU time** (``time.process_time``), the fastest round of ``--rounds`` of ``--steps`` steps,
  for the eager step, the phases it is made of (forward without and with the tape,
  forward + backward) and the hand-written NumPy step of ``tp_mlp_vs_mpi4py.py`` (the same
  arithmetic on rank 0's shards) in turns; ``--hidden`` (default 16, batch 4, in 8: data
  too small to compute) makes the kernels negligible, so mpipar minus hand-written is the
  dispatch: rules, reshard planning, tape, optimizer loop. ``--hidden 4096`` gives rank 0 the
  benchmark's shapes;
* **Python bytecodes** executed per step (``sys.settrace`` with opcode events; a NumPy call
  counts as one): the same work counted exactly, so two versions compare without the
  machine's load in the figure.

``--kernels`` then times the eager step once more with a clock around every op's kernel, the
optimizer's per-shard update and the stand-in all-reduce (perf_counter, inside the step), and
prints their time per step, op by op, against the step's CPU: what is left is the framework's
Python at these shapes (with ``--hidden 4096``, the Python running between kernels with the
caches the GEMMs filled).

``--ranks N`` gives rank 0 of ``mpiexec -n N`` its shapes (default 4). ``--copies K`` runs K
copies of this measurement at once, as independent processes (no MPI, nothing shared), and
prints each one's figures: K copies on a machine with fewer cores than K share cores and
caches as the ranks of ``mpiexec -n K`` do, without any communication between them, so the
eager step's extra CPU with ``--copies 4`` against ``--copies 1`` is what sharing the machine
alone costs it (``docs/performance.md``, "What remains").

Not counted: the MPI communicator's own Python around the all-reduce (``OrderedCommunicator``;
the stand-in replaces it) and waiting for other ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import numpy as np
import tp_mlp_vs_mpi4py as tp
from results import add_json_argument, record

import mpipar as dist
from mpipar import backward_replay
from mpipar.mesh import ProcessMesh
from mpipar.ops.dispatch import registered_ops
from simulator import SimBackend
from simulator.virtual_comm import VirtualCommunicator

RANKS = 4


class _StandInComm(VirtualCommunicator):
    """The all-reduce of a process hosting one member: every member is taken to hold this buffer."""

    def _all_reduce(self, group: tuple[int, ...], bufs: Mapping[int, Any], op: str) -> dict[int, Any]:
        return {r: a * len(group) if op == "sum" else a.copy() for r, a in bufs.items()}


class RankZero(SimBackend):
    """Hosts rank 0 of each mesh only, as MPI's process of rank 0 does."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size, reuse_freed_memory=False)
        self._comm = _StandInComm()

    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        return (0,) if 0 in mesh.process_ids else ()


class _World:
    """What ``tp_mlp_vs_mpi4py``'s steps ask of MPI's communicator, for rank 0 of ``RANKS``."""

    def Get_size(self) -> int:
        return RANKS

    def Get_rank(self) -> int:
        return 0

    def Allreduce(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = send * np.float32(RANKS)


def phases() -> dict[str, Callable[[], object]]:
    """The eager step and its phases, on fresh parameters."""
    step, _ = tp.ours(_World())  # type: ignore[arg-type]
    hand, _ = tp.hand_written(_World())  # type: ignore[arg-type]
    mesh = dist.ProcessMesh(list(range(RANKS)), dim_names=["mp"])
    v = tp.initial()
    x = dist.shard_tensor(v["x"], mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(v["w1"]), mesh, [dist.Shard(1)])
    b1 = dist.shard_tensor(dist.Parameter(v["b1"]), mesh, [dist.Shard(0)])
    w2 = dist.shard_tensor(dist.Parameter(v["w2"]), mesh, [dist.Shard(0)])
    b2 = dist.shard_tensor(dist.Parameter(v["b2"]), mesh, [dist.Replicate()])
    relu = dist.nn.functional.relu

    def forward() -> dist.Tensor:
        h = relu(dist.add(dist.matmul(x, w1), b1))
        z = dist.add(dist.matmul(h, w2), b2)
        return dist.mean(dist.multiply(z, z))

    def forward_no_tape() -> None:
        with dist.no_grad():
            forward()

    def forward_backward() -> None:
        forward().backward()
        for p in (w1, b1, w2, b2):
            p.clear_grad()

    return {
        "forward, no tape": forward_no_tape,
        "forward": forward,
        "forward + backward": forward_backward,
        "eager step": step,
        "hand-written": hand,
    }


def bytecodes(fn: Callable[[], object], steps: int = 5) -> float:
    """Python bytecodes executed per call of ``fn``."""
    count = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(steps):
            fn()
    finally:
        sys.settrace(None)
    return count[0] / steps


def kernel_split(step: Callable[[], object], steps: int, rounds: int) -> None:
    """Print the eager step's CPU per step split into its kernels (each op's, the optimizer's
    update, the stand-in all-reduce) and the rest, from the fastest of ``rounds`` rounds."""
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    clock = time.perf_counter

    def timing(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            out = fn(*args, **kwargs)
            spent[name] = spent.get(name, 0.0) + clock() - t0
            calls[name] = calls.get(name, 0) + 1
            return out

        return timed

    kernels = {op.name: op.kernel for op in registered_ops()}
    updates = {cls: cls._update for cls in (dist.optimizer.SGD,)}
    reduce_all = _StandInComm._all_reduce
    for op in registered_ops():
        object.__setattr__(op, "kernel", timing(op.name, op.kernel))  # (a frozen dataclass: benchmark only)
    for cls, fn in updates.items():
        cls._update = timing("optimizer update", fn)  # type: ignore[method-assign]
    _StandInComm._all_reduce = timing("all-reduce (stand-in)", reduce_all)  # type: ignore[method-assign]
    # A replayed backward pass calls the kernels its recording saw: record again with the clocks.
    backward_replay.forget_programs()
    try:
        best = (float("inf"), {}, {})
        for _ in range(rounds):
            spent.clear()
            calls.clear()
            t0 = time.process_time()
            for _ in range(steps):
                step()
            cpu = (time.process_time() - t0) / steps
            if cpu < best[0]:
                best = (cpu, dict(spent), dict(calls))
    finally:
        for op in registered_ops():
            object.__setattr__(op, "kernel", kernels[op.name])
        for cls, fn in updates.items():
            cls._update = fn  # type: ignore[method-assign]
        _StandInComm._all_reduce = reduce_all  # type: ignore[method-assign]
        backward_replay.forget_programs()
    cpu, by_name, counts = best
    inside = sum(by_name.values()) / steps
    print(f"eager step with clocks around its kernels: {cpu * 1e6:.0f} us CPU per step")
    for name, seconds in sorted(by_name.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {seconds / steps * 1e6:8.1f} us  ({counts[name] // steps} per step)")
    print(
        f"  {'kernels in all':24s} {inside * 1e6:8.1f} us; the rest (framework Python): {(cpu - inside) * 1e6:.0f} us"
    )


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Callable[[], object]]]:
    """This process's figures (per variant the fastest round's CPU per step and its bytecodes)
    and the variants measured."""
    global RANKS
    RANKS = args.ranks
    if args.hidden != 4096:  # tiny data: the framework's work alone
        tp.BATCH, tp.IN = 4, 8
    tp.HIDDEN = args.hidden
    dist.set_backend(RankZero(RANKS))
    variants = phases()
    for _ in range(20):
        for fn in variants.values():
            fn()
    counted = {name: bytecodes(fn) for name, fn in variants.items()}
    gc.collect()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(args.rounds):
        for name, fn in variants.items():
            t0 = time.process_time()
            for _ in range(args.steps):
                fn()
            best[name] = min(best[name], (time.process_time() - t0) / args.steps)
    return {"cpu_s": best, "bytecodes": counted}, variants


def report(figures: dict[str, Any], heading: str) -> None:
    best, counted = figures["cpu_s"], figures["bytecodes"]
    print(heading)
    print(f"{'':22s} {'CPU us/step':>12s} {'bytecodes/step':>15s}")
    for name in best:
        print(f"{name:22s} {best[name] * 1e6:12.0f} {counted[name]:15.0f}")
    dispatch = best["eager step"] - best["hand-written"]
    print(
        f"eager step minus hand-written: {dispatch * 1e6:.0f} us CPU per step "
        f"({best['eager step'] / best['hand-written']:.2f}x the hand-written step)"
    )


def run_copies(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``args.copies`` copies of this measurement, started together as separate processes."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        *("--steps", str(args.steps), "--rounds", str(args.rounds)),
        *("--hidden", str(args.hidden), "--ranks", str(args.ranks), "--print-json"),
    ]
    children = [
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        for _ in range(args.copies)
    ]
    outputs = [child.communicate()[0] for child in children]
    failed = [i for i, child in enumerate(children) if child.returncode != 0]
    if failed:
        raise SystemExit(f"copies {failed} failed (their errors are above)")
    return [json.loads(out) for out in outputs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--hidden", type=int, default=16, help="hidden width over all ranks (16: tiny data)")
    p.add_argument("--ranks", type=int, default=RANKS, help="the step of rank 0 of this many ranks (4)")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="run this many copies at once, as independent processes sharing the machine (1)",
    )
    p.add_argument("--kernels", action="store_true", help="also split the eager step's CPU into kernels and the rest")
    p.add_argument("--print-json", action="store_true", help="print the figures as one JSON object instead")
    add_json_argument(p)
    args = p.parse_args()
    if args.ranks < 1 or args.copies < 1:
        p.error(f"--ranks and --copies take a positive count (got {args.ranks} and {args.copies})")
    if args.copies > 1 and (args.kernels or args.print_json):
        p.error("--copies prints each copy's table: it takes neither --kernels nor --print-json")
    record(args.json, __file__)
    shapes = f"rank 0 of {args.ranks}"
    if args.copies > 1:
        load = tp.load_average()[0]
        results = run_copies(args)
        for i, figures in enumerate(results):
            report(figures, f"copy {i + 1} of {args.copies}:")
        extra = [(f["cpu_s"]["eager step"] - f["cpu_s"]["hand-written"]) * 1e6 for f in results]
        ratio = [f["cpu_s"]["eager step"] / f["cpu_s"]["hand-written"] for f in results]
        print(
            f"TP MLP step as {shapes}, {args.copies} copies at once on {os.cpu_count()} cores (load average "
            f"{load:.2f} before): eager step minus hand-written {min(extra):.0f}-{max(extra):.0f} us CPU per step, "
            f"{min(ratio):.2f}x-{max(ratio):.2f}x the hand-written step"
        )
        return
    figures, variants = measure(args)
    if args.print_json:
        print(json.dumps(figures), flush=True)
        return
    load = tp.load_average()[0]
    report(
        figures,
        f"TP MLP step as {shapes} (batch {tp.BATCH}, {tp.IN} -> {tp.HIDDEN} -> {tp.IN}), one process; "
        f"fastest of {args.rounds} rounds of {args.steps} steps; load average {load:.2f}",
    )
    if args.kernels:
        kernel_split(variants["eager step"], args.steps, args.rounds)


if __name__ == "__main__":
    main()
