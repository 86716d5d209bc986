"""How fast ``python -m simulator search`` ranks the whole space: GPT-3 175B on 1024 A100s.

    python benchmarks/search_speed.py            # 175B, 1024 devices, global batch 1536
    python benchmarks/search_speed.py --check    # also price the winner with estimate itself

Prints the machine's load average, the candidates enumerated, the wall and CPU seconds, how
many were priced exactly and how many each bound dropped, candidates per second, and the top 3
(CPU seconds are the figure to compare on a shared machine). ``--check``
traces the winner whole with ``simulator.estimate`` (about 5 s at 1024 ranks) and prints both
step times and peaks: the fast path must give the same numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from simulator.cost import load_profile
from simulator.estimate import estimate
from simulator.search import _progress_bar, search
from simulator.step_trace import GPTShape


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=1536)
    p.add_argument("--hardware", default="a100-nvlink-ib")
    p.add_argument("--check", action="store_true", help="price the winner with estimate too")
    ns = p.parse_args(argv)
    shape = GPTShape(96, 12288, 96, 2048, 51200)
    hw = load_profile(ns.hardware)
    started, cpu = time.perf_counter(), time.process_time()
    result = search(shape, ns.devices, ns.global_batch, hw, top_k=3, progress=_progress_bar)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print(f"GPT-3 175B on {ns.devices} x {ns.hardware}, global batch {ns.global_batch}")
    # The load says how much of the wall clock went to other processes on a shared machine.
    print("load average (1, 5, 15 min) at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    # CPU seconds too: on a shared machine the wall clock measures the neighbours as much as the search.
    print(
        f"{result.enumerated} candidates in {seconds:.1f} s wall, {cpu:.1f} s CPU "
        f"({result.enumerated / seconds:,.0f} candidates/s wall, {result.enumerated / cpu:,.0f} per CPU second); "
        f"{result.priced} priced exactly; dropped: " + ", ".join(f"{v} {k}" for k, v in result.pruned.items())
    )
    for rank, c in enumerate(result.ranked, 1):
        st = c.strategy
        print(
            f"#{rank} dp={st.dp} tp={st.tp} pp={st.pp} sp={st.sequence_parallel} recompute={st.recompute} "
            f"zero={st.zero} mbs={c.micro_batch_size} m={st.micro_batches} {st.schedule} chunks={st.chunks}: "
            f"step {c.step_time_s:.3f} s, MFU {c.mfu:.1%}, peak {c.peak_bytes / 2**30:.1f} GiB"
        )
    if ns.check and result.ranked:
        best = result.ranked[0]
        sized = GPTShape(96, 12288, 96, 2048, 51200, best.micro_batch_size)
        t = time.perf_counter()
        est = estimate(sized, best.strategy, hw)
        print(
            f"estimate itself ({time.perf_counter() - t:.1f} s): step {est.step_time_s:.6f} s "
            f"(search {best.step_time_s:.6f}), peak {max(est.peak_bytes_per_rank.values())} B (search {best.peak_bytes})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
