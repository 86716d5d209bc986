"""What the default cross-rank agreement check costs a training step (``MPIPAR_AGREE``).

    .venv/bin/python benchmarks/agreement_cost.py [-n 4] [--rounds 5] [--iters 20] [--gpt-steps 8] [--json]

Two steps, each with the check on and off:

* **TP MLP** (``tp_mlp_vs_mpi4py.py``'s step: batch 32, 256 -> 4096 -> 256, float32, the hidden
  dim split over ``-n`` ranks): one ``mpiexec`` launch runs the step with the check on and off in
  turns, step by step in a fresh random order (``steps_in_turns``), toggling the communicator's
  ``agree``; a round's time is each variant's median, the result the median of the rounds.
* **gpt.py** (``examples/gpt.py --tiny --mesh dp=2,tp=2``): whole launches with
  ``MPIPAR_AGREE=1`` and ``MPIPAR_AGREE=0`` alternate, round after round (the order flips every
  round); a launch's time is the median of its ``ms/step`` lines after the first two steps.

Both variants compute the same bits (the check only adds words to messages): the TP MLP
variants' losses are compared exactly before timing. Prints each step's time on and off and
the cost as a share of the step (aim: under 3%).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")},
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}


def mlp_worker(iters: int, rounds: int) -> None:
    """Under mpiexec: the TP MLP step with the check on and off, in turns; rank 0 prints JSON."""
    sys.path.insert(0, HERE)
    import numpy as np
    from mpi4py import MPI
    from tp_mlp_vs_mpi4py import ours, steps_in_turns

    import mpipar as dist

    world = MPI.COMM_WORLD
    comm = dist.current_backend().comm
    steps = {}
    losses = {}
    for label, agree in (("on", True), ("off", False)):
        step, _ = ours(world)

        def toggled(step=step, agree=agree) -> float:  # type: ignore[no-untyped-def]
            comm.agree = agree
            return step()

        losses[label] = [toggled() for _ in range(3)]
        steps[label] = toggled
    if losses["on"] != losses["off"]:
        raise SystemExit(f"the check changed the losses: {losses}")
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for label, times in steps_in_turns(world, steps, iters).items():
            medians[label].append(float(np.median(times)))
    comm.agree = True
    if world.Get_rank() == 0:
        print(json.dumps(medians), flush=True)


def run_mlp(n: int, iters: int, rounds: int) -> dict[str, float]:
    proc = subprocess.run(
        [
            MPIEXEC,
            "-n",
            str(n),
            sys.executable,
            __file__,
            "--mlp-worker",
            "--iters",
            str(iters),
            "--rounds",
            str(rounds),
        ],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"TP MLP worker failed:\n{proc.stdout}\n{proc.stderr}")
    medians = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: statistics.median(v) for k, v in medians.items()}


_STEP = re.compile(r"step (\d+): ([0-9.]+) ms/step")


def gpt_launch(agree: bool, steps: int) -> float:
    """One ``examples/gpt.py`` launch: the median ms/step after its first two steps."""
    cmd = [MPIEXEC, "-n", "4", sys.executable, "examples/gpt.py", "--tiny", "--mesh", "dp=2,tp=2"]
    cmd += ["--steps", str(steps), "--log-every", "1"]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**ENV, "MPIPAR_AGREE": "1" if agree else "0"},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"gpt.py failed:\n{proc.stdout}\n{proc.stderr}")
    times = [float(m.group(2)) for m in _STEP.finditer(proc.stdout + proc.stderr) if int(m.group(1)) >= 2]
    if not times:
        raise SystemExit(f"gpt.py printed no step times:\n{proc.stderr}")
    return statistics.median(times) / 1e3


def run_gpt(rounds: int, steps: int) -> dict[str, float]:
    got: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for agree in order:
            got["on" if agree else "off"].append(gpt_launch(agree, steps))
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4, help="ranks of the TP MLP run (gpt.py runs on 4: dp=2, tp=2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="TP MLP steps per variant and round")
    p.add_argument("--gpt-steps", type=int, default=8, help="steps of each gpt.py launch (the first two are not timed)")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--mlp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mlp_worker:
        mlp_worker(args.iters, args.rounds)
        return
    results = {"tp_mlp": run_mlp(args.n, args.iters, args.rounds)}
    if not args.skip_gpt:
        results["gpt"] = run_gpt(args.rounds, args.gpt_steps)
    for r in results.values():
        r["cost"] = r["on"] / r["off"] - 1
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        print(
            f"{name:7s} check on {r['on'] * 1e3:8.3f} ms/step, off {r['off'] * 1e3:8.3f} ms/step: {100 * r['cost']:+.2f}%"
        )


if __name__ == "__main__":
    main()
