"""What recompute costs ``--auto``'s search: the space with and without it, timed in one process.

    .venv/bin/python benchmarks/auto_recompute_space.py [--world 4] [--limit BYTES]

``examples/gpt.py --tiny``'s model (4 layers, hidden 16, 2 heads, sequence 16, vocabulary 128,
global batch 8) on ``--world`` ranks, priced on the ``cpu-local`` preset in float32, top 2:
(a) recompute none only (the old ``--auto`` space); (b) none/selective/full with dominated
candidates dropped (``simulator.auto.choose``); (c) none/selective/full priced without the
dominance rule. Prints each one's CPU seconds of this process (the machine is shared: wall time
mostly measures the neighbours), wall seconds, candidates priced and best strategy, and the CPU
time ratios to (a), after one untimed warm-up search (the first search in a process pays for
imports and caches). ``--limit``: bytes per rank (default: the host's memory over the ranks).
"""

from __future__ import annotations

import argparse
import time

from results import add_json_argument, record

import mpipar as dist
from simulator.auto import memory_limit
from simulator.backend import ShapeOnlyBackend
from simulator.cost import load_profile
from simulator.search import RECOMPUTES, SearchResult, search
from simulator.step_trace import GPTShape

TINY = GPTShape(4, 16, 2, 16, 128, 1, 0.1)


def timed(
    world: int, limit: int, recomputes: tuple[str, ...], drop_dominated: bool
) -> tuple[float, float, SearchResult]:
    hw = load_profile("cpu-local")
    cpu, started = time.process_time(), time.perf_counter()
    with dist.use_backend(ShapeOnlyBackend()):
        result = search(
            TINY,
            world,
            8,
            hw,
            memory_limit=limit,
            top_k=2,
            mixed_precision=False,
            recomputes=recomputes,
            drop_dominated=drop_dominated,
        )
    return time.process_time() - cpu, time.perf_counter() - started, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--limit", type=int, default=None)
    add_json_argument(ap)
    args = ap.parse_args()
    record(args.json, __file__)
    limit = args.limit or memory_limit(load_profile("cpu-local"), args.world)
    print(f"--tiny GPT on {args.world} ranks, batch 8, cpu-local, memory limit {limit:,} bytes per rank")
    timed(args.world, limit, ("none",), False)  # warm-up
    base = None
    for name, rcs, dominated in (
        ("none only", ("none",), False),
        ("all, dominated dropped", RECOMPUTES, True),
        ("all, every candidate", RECOMPUTES, False),
    ):
        seconds, wall, result = timed(args.world, limit, rcs, dominated)
        base = base or seconds
        best = result.ranked[0].strategy if result.ranked else None
        what = (
            f"dp={best.dp},tp={best.tp},pp={best.pp} recompute {best.recompute} zero {best.zero}"
            if best
            else "nothing fits"
        )
        print(
            f"  {name:<24} {seconds:6.2f} s CPU ({wall:6.2f} s wall)  ratio {seconds / base:5.2f}  {result.enumerated:4d} candidates, "
            f"{result.priced:3d} priced; best: {what}"
        )


if __name__ == "__main__":
    main()
