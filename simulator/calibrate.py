"""``python -m simulator calibrate``: measure this machine and write a hardware profile.

    python -m simulator calibrate -o profile.json      # about 10 s
    python -m simulator calibrate --quick              # fewer sizes, shorter budget

Runs ``simulator/calibrate_worker.py`` under this venv's ``mpiexec -n 2`` (one BLAS thread per
rank), which times raw mpi4py ping-pong and ``Allreduce`` at several message sizes and NumPy
GEMM, then fits the alpha-beta model:

* the point-to-point link from the ping-pong one-way times, ``t(S) = alpha + S / bandwidth``,
  by least squares on relative error (so 8-byte latencies weigh as much as 4 MiB transfers);
* the reduction throughput ``gamma`` from what ``Allreduce`` takes beyond the ring formula on
  that link (on CPUs the summing is as slow as the copying); left ``None`` if nothing is left;
* a ring fit of ``Allreduce`` alone, kept beside them as a check;
* the CPU model (``simulator.calibrate_host``): GEMM efficiency by size (``gemm_curve``, over
  square, batched, per-sequence and attention-like shapes; ``flops_per_s`` is its best size
  class), the elementwise rate by bytes (``vector_curve``: cache-resident arrays run faster
  than ones streamed from memory) and mpipar's host seconds per op, reshard call and parameter
  update (``op_overhead_s``, ``reshard_overhead_s``, ``update_overhead_s``), which ``estimate``
  and the search use by default;
* the kernel scale (``kernel_scale``): gpt.py's default model timed at two micro-batches on
  every rank at once, the growth of its forward+backward over the growth the rates above price
  (``calibrate_host.kernel_scale``); a step's kernels run slower than tight loops, and every
  kernel ``estimate``, ``--auto`` and the dashboard price on this profile is scaled by it.

The profile (``simulator.cost.HardwareProfile`` JSON) puts every rank on one node (both link
classes are the measured one), takes the GEMM rates as ``flops_per_s`` with efficiency 1.0, and
keeps the raw measurements and the formula's predictions under ``calibration``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

import mpipar as dist
from mpipar import cliargs
from simulator import calibrate_host
from simulator.backend import ShapeOnlyBackend
from simulator.cost import MAX_KERNEL_SCALE, MIN_KERNEL_SCALE, HardwareProfile, Link, collective_time
from simulator.op_cost import PlanCosts
from simulator.step_trace import SETUP, GPTShape, GPTStrategy, trace_gpt_step

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrate_worker.py")
SIZES = (8, 1024, 16384, 131072, 1 << 20, 4 << 20)
QUICK_SIZES = (8, 16384, 1 << 20)


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], steps: float = 1.0, volume: float = 1.0) -> Link:
    """Fit ``t = steps*alpha + volume*S/bandwidth`` minimising relative error; alpha kept >= 0.

    ``steps``/``volume`` are the formula's coefficients (1, 1 for a send; 2(n-1), 2(n-1)/n for a
    ring all-reduce), so a collective's timings yield the per-link alpha and bandwidth.
    """
    s = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if s.size < 2 or s.size != t.size or (t <= 0).any():
        raise ValueError(f"fit_alpha_beta needs >= 2 positive timings at distinct sizes, got {list(s)} / {list(t)}")
    if t[s.argmax()] <= t[s.argmin()]:
        raise ValueError(f"timings do not grow with message size; sizes {list(s)}, times {list(t)}")
    design = np.stack([steps / t, volume * s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0 or beta <= 0:
        # Noise (a busy machine) pulled the free fit out of range: take the latency from the
        # fastest smallest message and fit only the slope, relative error again.
        alpha = max(0.0, float(t[s == s.min()].min()) / steps)
        x = volume * s / t
        beta = float(np.sum(x * (t - steps * alpha) / t) / np.sum(x * x))
        if beta <= 0:
            alpha, beta = 0.0, float(np.sum(x) / np.sum(x * x))
    return Link(float(alpha), float(1.0 / beta))


def fit_reduction(nbytes: Sequence[float], seconds: Sequence[float], group_size: int, link: Link) -> float | None:
    """Reduction throughput (bytes/s) explaining all-reduce time beyond the ring formula on ``link``.

    Fits ``residual = (n-1)/n * S * gamma`` on relative error; ``None`` when the residual does not grow.
    """
    n = group_size
    s = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    base = np.array([collective_time("all_reduce", x, n, link) for x in s])
    x = (n - 1) / n * s / t
    gamma = float(np.sum(x * (t - base) / t) / np.sum(x * x))
    return 1.0 / gamma if gamma > 0 else None


def run_worker(ranks: int, sizes: Sequence[int], budget_s: float, gemm_n: int, timeout_s: float) -> dict[str, Any]:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        raise SystemExit(f"python -m simulator calibrate: no mpiexec next to {sys.executable}; install the mpich wheel")
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        env[var] = "1"
    config = json.dumps(
        {
            "sizes": list(sizes),
            "budget_s": budget_s,
            "gemm_n": gemm_n,
            "kernels": True,
            "host_steps": 8 if budget_s < 0.5 else 20,
        }
    )
    cmd = [mpiexec, "-n", str(ranks), sys.executable, WORKER, config]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"python -m simulator calibrate: the MPI worker took over {timeout_s:g} s; is mpiexec working?"
        ) from None
    if proc.returncode != 0:
        raise SystemExit(
            f"python -m simulator calibrate: `{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"python -m simulator calibrate: the worker printed no result:\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def calibrate(*, quick: bool = False, ranks: int = 2, timeout_s: float = 120.0) -> HardwareProfile:
    """Measure this machine (MPI point-to-point, Allreduce, GEMM) and return its profile."""
    if ranks < 2:
        raise ValueError(f"calibrate needs at least 2 MPI ranks for ping-pong, got {ranks}")
    sizes = QUICK_SIZES if quick else SIZES
    started = time.perf_counter()
    raw = run_worker(ranks, sizes, budget_s=0.15 if quick else 0.6, gemm_n=256 if quick else 512, timeout_s=timeout_s)
    p2p = fit_alpha_beta(raw["pingpong"]["bytes"], raw["pingpong"]["seconds"])
    n = raw["ranks"]
    ring = fit_alpha_beta(
        raw["allreduce"]["bytes"], raw["allreduce"]["seconds"], steps=2 * (n - 1), volume=2 * (n - 1) / n
    )
    reduction = fit_reduction(raw["allreduce"]["bytes"], raw["allreduce"]["seconds"], n, p2p)
    predicted = [collective_time("all_reduce", s, n, p2p, reduction) for s in raw["allreduce"]["bytes"]]
    # The CPU model: GEMM efficiency and elementwise rate by kernel size, host costs per call.
    bin_peak, curve = calibrate_host.gemm_curve(raw["gemm_curve"])
    rate32 = float(raw["gemm"]["float32"]["flops_per_s"])
    peak = max(bin_peak, rate32)  # the curve is a share of the fastest GEMM measured
    curve = [(f, e * bin_peak / peak) for f, e in curve]
    flops_per_s = {dtype: float(g["flops_per_s"]) * peak / rate32 for dtype, g in raw["gemm"].items()}
    host = socket.gethostname()
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    calibration = {
        "host": host,
        "cpus": os.cpu_count(),
        "ranks": n,
        "blas_threads_per_rank": 1,
        "mpi_library": raw.get("mpi_library", ""),
        "seconds_taken": round(time.perf_counter() - started, 3),
        "pingpong": raw["pingpong"],
        "allreduce": {**raw["allreduce"], "predicted": predicted},
        "gemm": raw["gemm"],
        "gemm_shapes": raw["gemm_curve"],
        "vector": raw["vector_curve"],
        "host_costs": raw["host"],
        "fit": {"p2p": p2p.to_dict(), "reduction_Bps": reduction, "allreduce_ring": ring.to_dict()},
    }
    profile = HardwareProfile(
        name=f"calibrated-{host}",
        intra_node=p2p,
        inter_node=p2p,
        flops_per_s=flops_per_s,
        devices_per_node=None,
        compute_efficiency=1.0,
        reduction_Bps=reduction,
        memory_bytes=int(phys) if phys else None,
        description=(
            f"measured on {host} with {n} MPI ranks (one BLAS thread each) by `python -m simulator calibrate`; "
            "both link classes are the measured shared-memory link; flops_per_s is the fastest GEMM size class "
            "measured (other dtypes in the 512x512 GEMMs' proportion), gemm_curve and vector_curve the kernel "
            "rates by size, the *_overhead_s mpipar's host costs, all with every rank measuring at once"
        ),
        calibration=calibration,
        gemm_curve=tuple(curve),
        vector_curve=tuple(calibrate_host.vector_curve(raw["vector_curve"])),
        op_overhead_s=float(raw["host"]["op"]),
        reshard_overhead_s=float(raw["host"]["reshard"]),
        update_overhead_s=float(raw["host"]["update"]),
        optimizer_op_overhead_s=float(raw["host"].get("optimizer_op", raw["host"]["op"])),
        grad_sync_s=float(raw["host"]["grad_sync"]) if "grad_sync" in raw["host"] else None,
    )
    calibration["kernel_probe"] = probe = {"measured_s": raw["kernel_probe"]}
    measured = {int(b): float(t) for b, t in raw["kernel_probe"].items()}
    priced = {b: priced_kernel_seconds(profile, b) for b in calibrate_host.KERNEL_BATCHES}
    probe["priced_s"] = {str(b): t for b, t in priced.items()}
    try:
        scale = calibrate_host.kernel_scale(measured, priced)
        if not MIN_KERNEL_SCALE <= scale <= MAX_KERNEL_SCALE:
            raise ValueError(f"kernel probe: scale {scale:.3g} is outside [{MIN_KERNEL_SCALE:g}, {MAX_KERNEL_SCALE:g}]")
    except ValueError as exc:
        # A burst of load between the two runs: the rates stand unscaled, and the profile says why.
        probe["error"] = str(exc)
        return profile
    probe["kernel_scale"] = scale
    return replace(profile, kernel_scale=scale)


def priced_kernel_seconds(profile: HardwareProfile, batch: int) -> float:
    """Kernel seconds (no host costs) ``profile`` prices one forward+backward of the kernel
    probe's model at ``batch`` sequences on one rank at (``calibrate_host.kernel_probe``)."""
    cfg = calibrate_host.KERNEL_MODEL
    shape = GPTShape(cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["block_size"], cfg["vocab_size"], batch, 0.0)
    with dist.use_backend(ShapeOnlyBackend()):
        step = trace_gpt_step(shape, GPTStrategy(), layers_traced=shape.layers)
    costs = PlanCosts(step.plan, profile, op_overhead=0.0, reshard_overhead=0.0)
    total = 0.0
    for op, part in zip(step.plan.ops, step.op_parts, strict=True):
        if part != SETUP and op.phase in ("forward", "backward"):
            times = costs.op_times(op)
            total += times.get(0, 0.0) if isinstance(times, dict) else times
    return total


def main(argv: list[str] | None = None) -> int:
    parser = cliargs.Parser(
        prog="python -m simulator calibrate",
        description="Measure MPI latency/bandwidth and NumPy GEMM rate on this machine; write a hardware profile.",
    )
    parser.add_argument(
        "-o",
        "--output",
        default="profile.json",
        type=cliargs.output_path,
        help="where to write the profile (default profile.json)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter timing loops (a few seconds)")
    parser.add_argument(
        "-n", "--ranks", type=cliargs.int_range(1, 1024, "a rank count"), default=2, help="MPI ranks to run (default 2)"
    )
    parser.add_argument(
        "--timeout",
        type=cliargs.finite_float(1.0, 86400.0, "seconds"),
        default=120.0,
        help="seconds before giving up on the MPI worker",
    )
    ns = parser.parse_args(argv)
    if ns.ranks < 2:
        parser.error(f"-n must be at least 2 (ping-pong needs two ranks), got {ns.ranks}")
    profile = calibrate(quick=ns.quick, ranks=ns.ranks, timeout_s=ns.timeout)
    cal = profile.calibration or {}
    link = profile.intra_node
    print(f"point-to-point: alpha {link.alpha_s * 1e6:.2f} us, bandwidth {link.bandwidth_Bps / 1e9:.2f} GB/s")
    red = profile.reduction_Bps
    print("reduction: " + (f"{red / 1e9:.2f} GB/s" if red else "no measurable cost beyond the link"))
    ring = cal["fit"]["allreduce_ring"]
    print(
        f"allreduce (ring fit, {cal['ranks']} ranks): alpha {ring['alpha_s'] * 1e6:.2f} us, "
        f"bandwidth {ring['bandwidth_Bps'] / 1e9:.2f} GB/s"
    )
    for s, measured, predicted in zip(
        cal["allreduce"]["bytes"], cal["allreduce"]["seconds"], cal["allreduce"]["predicted"], strict=True
    ):
        print(f"  allreduce {s:>9d} B: measured {measured * 1e6:10.2f} us, predicted {predicted * 1e6:10.2f} us")
    for dtype, rate in profile.flops_per_s.items():
        print(f"GEMM {dtype}: {rate / 1e9:.2f} GFLOP/s per rank at best")
    print("GEMM efficiency by size: " + ", ".join(f"{f:.2g} FLOP {e:.2f}" for f, e in profile.gemm_curve))
    print(
        "elementwise by size: "
        + ", ".join(f"{b / 1024:.0f} KiB {r / 1e9:.2f} GFLOP/s" for b, r in profile.vector_curve)
    )
    print(
        f"host: {profile.op_overhead_s * 1e6:.0f} us per op, {profile.reshard_overhead_s * 1e6:.0f} us per reshard call, "
        f"{profile.update_overhead_s * 1e6:.0f} us per parameter update, "
        f"{(profile.optimizer_op_overhead_s or 0.0) * 1e6:.0f} us per optimizer-phase (clip) op, "
        f"{(profile.grad_sync_s or 0.0) * 1e6:.0f} us per gradient all-reduce of a data-parallel backward"
    )
    probe = cal.get("kernel_probe", {})
    print(
        f"kernels in a training step: {profile.kernel_scale:.2f} x the tight-loop rates' time"
        + (f" (probe failed, left at 1: {probe['error']})" if "error" in probe else "")
    )
    profile.save(ns.output)
    print(f"wrote {ns.output} ({cal['seconds_taken']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
