"""Does gpt.py learn? 200 steps on 8 virtual ranks (dp2 x tp4); the loss must fall by >= 30%.

    .venv/bin/python benchmarks/gpt_convergence.py [--steps 200]

Runs examples/gpt.py under ``python -m simulator -n 8`` and compares the loss at the start (step
0: the untrained model, about ln(vocab)) with the mean of the last 10 steps (single steps are
noisy).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from results import add_json_argument, record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    add_json_argument(p)
    args = p.parse_args()
    record(args.json, __file__)
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "simulator",
            "-n",
            "8",
            "examples/gpt.py",
            "--mesh",
            "dp=2,tp=4",
            "--steps",
            str(args.steps),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", out.stdout, re.M)]
    first, last = losses[0], sum(losses[-10:]) / 10
    drop = 1 - last / first
    print(
        f"{len(losses)} steps in {time.perf_counter() - t0:.0f} s; loss at the start {first:.3f}, mean of the last 10 "
        f"steps {last:.3f}: {drop:.0%} lower ({'meets' if drop >= 0.3 else 'misses'} the 30% target)"
    )


if __name__ == "__main__":
    main()
