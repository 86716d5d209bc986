"""A small training loop for the launcher's tests: all-reduces per step, one rank misbehaves.

    mpipar launch -n 4 -- tests/scripts/launch_faults.py --steps 6 --fault hang --rank 2 --at 3

``--fault``: ``none``; ``raise`` (RuntimeError at step ``--at`` on ``--rank``); ``hang`` (a
Python loop that never ends, outside any collective); ``exit`` (``os._exit(3)``).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import mpipar as dist


def spin_forever() -> None:
    """Busy in Python, never calling mpipar again: what the heartbeat must catch."""
    n = 0
    while True:
        n += 1
        if n % 1_000_000 == 0:
            time.sleep(0.001)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--fault", default="none", choices=["none", "raise", "hang", "exit"])
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--at", type=int, default=2)
    p.add_argument("--report-host", action="store_true", help="each rank prints hydra's and mpipar's idea of its host")
    p.add_argument("--tp-mesh", action="store_true", help="also use a 2x2 (dp, tp) mesh in rank order")
    args = p.parse_args()
    world = dist.get_world_size()
    mesh = dist.ProcessMesh(list(range(world)), dim_names=["dp"])
    rank = dist.get_rank()
    if args.report_host:
        print(f"host {rank} {os.environ.get('PMI_HOSTNAME')} {(dist.rank_hosts() or ['?'] * world)[rank]}", flush=True)
    if args.tp_mesh:
        grid = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
        dist.shard_tensor(np.ones((4, 4)), grid, [dist.Shard(0), dist.Shard(1)])
    for step in range(args.steps):
        if step == args.at and rank == args.rank:
            if args.fault == "raise":
                raise RuntimeError(f"boom at step {step}")
            if args.fault == "hang":
                spin_forever()
            if args.fault == "exit":
                os._exit(3)
        x = dist.shard_tensor(np.full((world, 2), float(step)), mesh, [dist.Shard(0)])
        total = float(dist.reshard(x, mesh, [dist.Replicate()]).numpy().sum())
        dist.print_once(f"step {step} total {total:g}", flush=True)
        dist.mark_step(step)


if __name__ == "__main__":
    main()
