"""What the default cross-rank agreement check costs a training step (``MPIPAR_AGREE``).

    .venv/bin/python benchmarks/agreement_cost.py [-n 4] [--rounds 5] [--iters 20] [--gpt-iters 6] [--json]

Two steps, each with the check on and off:

* **TP MLP** (``tp_mlp_vs_mpi4py.py``'s step: batch 32, 256 -> 4096 -> 256, float32, the hidden
  dim split over ``-n`` ranks): one ``mpiexec`` launch runs the step with the check on and off in
  turns, step by step in a fresh random order (``steps_in_turns``), toggling the communicator's
  ``agree``; a round's time is each variant's median, the result the median of the rounds.
* **gpt.py** (its default model, ``--mesh dp=2,tp=2``, batch 16: forward, backward, clipped
  AdamW, as ``examples/gpt.py`` runs it) on 4 ranks: the same turns in one launch.

Both variants compute the same bits (the check only adds words to messages): the TP MLP
and gpt.py variants' losses are compared exactly before timing. Prints each step's time on and off and
the cost as a share of the step (aim: under 3%).
"""

from __future__ import annotations

import argparse
import json
import os
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
        for label, times in steps_in_turns(world, steps, iters)[0].items():  # the slowest rank's
            medians[label].append(float(np.median(times)))
    comm.agree = True
    if world.Get_rank() == 0:
        print(json.dumps(medians), flush=True)


def gpt_worker(iters: int, rounds: int) -> None:
    """Under mpiexec -n 4: gpt.py's default model on dp=2, tp=2 (batch 16, forward, backward,
    clipped AdamW), the check on and off in turns as ``mlp_worker`` does; rank 0 prints JSON."""
    sys.path.insert(0, HERE)
    import numpy as np
    import predict_vs_measure as pvm
    from mpi4py import MPI
    from tp_mlp_vs_mpi4py import steps_in_turns

    import mpipar as dist
    from mpipar.models.gpt import GPTParallel

    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        raise SystemExit(f"agreement_cost: the gpt.py step runs on 4 ranks (dp=2, tp=2), not {world.Get_size()}")
    comm = dist.current_backend().comm
    steps = {}
    losses = {}
    for label, agree in (("on", True), ("off", False)):
        dist.seed(0)
        par = GPTParallel.from_degrees(2, 2, 1)
        model, opt, idx = pvm.gpt_training_parts(par, par.stage_meshes[0], pvm.GLOBAL_BATCH)

        def step(model=model, opt=opt, idx=idx, agree=agree) -> float:  # type: ignore[no-untyped-def]
            comm.agree = agree
            loss = model.loss(idx, idx)
            loss.backward()
            value = float(loss)
            opt.step()
            opt.clear_grad()
            return value

        losses[label] = [step() for _ in range(2)]
        steps[label] = step
    if losses["on"] != losses["off"]:
        raise SystemExit(f"the check changed the losses: {losses}")
    medians: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for label, times in steps_in_turns(world, steps, iters, warmup=1)[0].items():  # the slowest rank's
            medians[label].append(float(np.median(times)))
    comm.agree = True
    if world.Get_rank() == 0:
        print(json.dumps(medians), flush=True)


def run_worker(kind: str, n: int, iters: int, rounds: int) -> dict[str, float]:
    cmd = [MPIEXEC, "-n", str(n), sys.executable, __file__, "--worker", kind]
    cmd += ["--iters", str(iters), "--rounds", str(rounds)]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed:\n{proc.stdout}\n{proc.stderr}")
    medians = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: statistics.median(v) for k, v in medians.items()} | {"rounds": medians}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=4, help="ranks of the TP MLP run (gpt.py runs on 4: dp=2, tp=2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20, help="TP MLP steps per variant and round")
    p.add_argument("--gpt-iters", type=int, default=6, help="gpt.py steps per variant and round")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--worker", choices=["mlp", "gpt"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "mlp":
        mlp_worker(args.iters, args.rounds)
        return
    if args.worker == "gpt":
        gpt_worker(args.iters, args.rounds)
        return
    results = {"tp_mlp": run_worker("mlp", args.n, args.iters, args.rounds)}
    if not args.skip_gpt:
        results["gpt"] = run_worker("gpt", 4, args.gpt_iters, args.rounds)
    for r in results.values():
        r["cost"] = r["on"] / r["off"] - 1
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        r.pop("rounds", None)
        print(
            f"{name:7s} check on {r['on'] * 1e3:8.3f} ms/step, off {r['off'] * 1e3:8.3f} ms/step: {100 * r['cost']:+.2f}%"
        )


if __name__ == "__main__":
    main()
