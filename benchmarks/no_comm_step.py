"""Which term of dp=8's predicted step is off? The step's per-rank work without its collectives, measured.

    .venv/bin/python benchmarks/no_comm_step.py --profile profile.json [--rounds 3] [--steps 10]

``predict_vs_measure.py`` splits a strategy's predicted step into compute (kernels), host (per-op
and per-update Python time) and comm (each collective at its own gap). For dp=8 every rank runs
gpt.py's default model on 2 sequences and then all-reduces its gradients; nothing else is
communicated. So the step's compute+host is what 8 ranks take, all at once on this machine,
running that model on 2 sequences on their own one-rank meshes (forward, backward, the clipped
AdamW update) with no collective at all: ``free`` (the ranks never synchronise) and ``barrier``
(one ``MPI_Barrier`` per step, the least synchronisation a data-parallel step has). ``dp8`` is the
same loop on the real dp=8 mesh (the gradient all-reduces included), and ``gpt.py`` the example
itself as ``predict_vs_measure.measure`` runs it. The runs and ``predict_vs_measure``'s worker
(the constants the prediction is priced with) are interleaved in rounds (``round_order``); every
number is the median of its rounds. Printed: measured no-comm step against predicted
compute+host, and measured (step - no-comm) against predicted comm (the benchmark's pricing,
with ``opt x`` and ``comm x``, and the pricing before them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import predict_vs_measure as pvm  # noqa: E402  (a sibling script, not a package)
from results import add_json_argument, record  # noqa: E402  (a sibling script, not a package)

MODES = ("free", "barrier", "dp8")
"""The worker's loops: one-rank meshes unsynchronised, one-rank meshes and a barrier per step, the dp=8 mesh."""


def worker(mode: str, steps: int) -> None:
    """Each rank: ``steps`` training steps of gpt.py's default model on 2 sequences (dp=8's per-rank
    batch) in ``mode``; rank 0 prints the median seconds per step (its own, and every rank's median)."""
    from mpi4py import MPI

    import mpipar as dist
    from mpipar.models.gpt import GPTParallel

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 8:
        raise SystemExit(f"no_comm_step: run under mpiexec -n 8, not {size}")
    dist.seed(0)
    if mode == "dp8":
        par = GPTParallel.from_degrees(8, 1, 1)
        mesh = par.stage_meshes[0]
        batch = pvm.GLOBAL_BATCH
    else:
        mesh = dist.ProcessMesh([[rank]], dim_names=["dp", "tp"])
        par = GPTParallel([mesh])
        batch = pvm.GLOBAL_BATCH // 8
    model, opt, idx = pvm.gpt_training_parts(par, mesh, batch)

    def step() -> None:
        loss = model.loss(idx, idx)
        loss.backward()
        float(loss)
        opt.step()
        opt.clear_grad()
        if mode == "barrier":
            comm.Barrier()

    step()
    comm.Barrier()
    stamps = [time.perf_counter()]
    for _ in range(steps):
        step()
        stamps.append(time.perf_counter())
    mine = statistics.median(b - a for a, b in itertools.pairwise(stamps))
    every = comm.gather(mine, root=0)
    if rank == 0:
        print(json.dumps({"rank0": mine, "ranks": statistics.median(every)}))


def run_worker(mode: str, steps: int) -> dict[str, float]:
    return pvm.worker_json(__file__, ["--worker", mode, "--steps", str(steps)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a calibrated hardware profile (python -m simulator calibrate -n 8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save", help="write every round's numbers to this JSON file")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    add_json_argument(parser)
    ns = parser.parse_args()
    record(ns.json, __file__)
    if ns.steps < 3 or ns.rounds < 1:
        parser.error(f"--steps must be >= 3 and --rounds >= 1, got {ns.steps} and {ns.rounds}")
    if ns.worker:
        worker(ns.worker, ns.steps)
        return
    if not ns.profile:
        parser.error("--profile is required (a profile of python -m simulator calibrate -n 8)")
    sys.path.insert(0, ROOT)
    from simulator.cost import load_profile

    profile = load_profile(ns.profile)
    names = [pvm.HOST, "gpt.py", *MODES]

    def run(name: str, round_: int) -> object:
        if name == pvm.HOST:
            out: object = pvm.host_costs(20)
        elif name == "gpt.py":
            out = pvm.measure("dp=8", ns.steps)[0]
        else:
            out = run_worker(name, ns.steps)
        shown = out if isinstance(out, float) else {k: round(v, 4) for k, v in out.items()} if name != pvm.HOST else ""  # type: ignore[union-attr]
        print(f"  round {round_ + 1}: {name:<10} {shown}  (load average {os.getloadavg()[0]:.1f})", flush=True)
        return out

    load_start = os.getloadavg()
    results = pvm.interleaved(names, ns.rounds, run)
    load_end = os.getloadavg()
    host, _ = pvm.steady(results[pvm.HOST])  # type: ignore[arg-type]
    probes = {b: pvm.one_rank_step(b) for b in pvm.KERNEL_BATCHES}
    now = pvm.at_load(profile, host["gemm_flops"], host["vector_flops"])
    curve_x = pvm.kernel_scale(
        {b: host[f"model_fb{b}"] for b in pvm.KERNEL_BATCHES},
        {b: pvm.kernel_seconds(probes[b], now, None) for b in pvm.KERNEL_BATCHES},
    )
    step = pvm.gpt_step("dp=8")
    free = pvm.loaded_profile(now, 0.0, curve_x)
    alpha, base = pvm.loaded_latency(host, pvm.collectives(step, free, host, None))
    old = pvm.predicted_breakdown(step, pvm.loaded_profile(now, alpha, curve_x), host, base, None)
    # The benchmark's pricing now: the optimizer phase times opt x, the collectives times comm x.
    opt_x, comm_x = pvm.step_scales(host, free, None, *pvm.step_probes())
    scaled = pvm.scaled_collectives(host, comm_x)
    alpha, base = pvm.loaded_latency(scaled, pvm.collectives(step, free, host, None))
    parts = pvm.predicted_breakdown(step, pvm.loaded_profile(now, alpha, curve_x), host, base, None, opt_x)
    print(
        f"\nwithout opt x and comm x (the pricing before): compute {old['compute']:.4f} s, host {old['host']:.4f} s, "
        f"comm {old['comm']:.4f} s; opt x {opt_x:.2f}, comm x {comm_x:.2f}"
    )
    gpt = statistics.median(results["gpt.py"])  # type: ignore[arg-type]
    med = {m: statistics.median(r["rank0"] for r in results[m]) for m in MODES}  # type: ignore[index]
    every = {m: statistics.median(r["ranks"] for r in results[m]) for m in MODES}  # type: ignore[index]
    print(
        f"curve x {curve_x:.2f}; predicted (curve/x) dp=8: compute {parts['compute']:.4f} s, host {parts['host']:.4f} s, "
        f"comm {parts['comm']:.4f} s, step {sum(parts.values()):.4f} s"
    )
    print(f"measured: gpt.py dp=8 {gpt:.4f} s ({'/'.join(f'{x:.3f}' for x in results['gpt.py'])})")  # type: ignore[union-attr]
    for m in MODES:
        each = "/".join(f"{r['rank0']:.3f}" for r in results[m])  # type: ignore[index]
        print(f"          {m:<8} {med[m]:.4f} s rank 0, {every[m]:.4f} s every rank's median  ({each})")
    ch = parts["compute"] + parts["host"]
    for m in ("free", "barrier"):
        print(
            f"no-comm ({m}): measured {med[m]:.4f} s vs predicted compute+host {ch:.4f} s (pred/meas {ch / med[m]:.2f}); "
            f"gpt.py - no-comm {gpt - med[m]:.4f} s vs predicted comm {parts['comm']:.4f} s"
        )
    # The kernel probe at micro-batch 2 is dp=8's forward+backward without comm: what the
    # prediction prices it at (kernels at curve/x, ops at the host time per op) against its time.
    for b in pvm.KERNEL_BATCHES:
        kern = pvm.kernel_seconds(probes[b], free, None)
        ops = len(pvm.forward_backward_ops(probes[b]))
        print(
            f"probe fb at micro-batch {b}: measured {host[f'model_fb{b}']:.4f} s, predicted {kern + ops * host['op']:.4f} s "
            f"(kernels {kern:.4f} s, {ops} ops x {host['op'] * 1e6:.0f} us)"
        )
    print(f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")
    if ns.save:
        with open(ns.save, "w") as f:
            json.dump({"results": results, "parts": parts, "curve_x": curve_x}, f, indent=1)


if __name__ == "__main__":
    main()
