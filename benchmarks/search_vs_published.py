"""The search against Narayanan et al. 2021 Table 1 (``simulator.published_configs``).

    python benchmarks/search_vs_published.py                 # the first two rows, narrow space
    python benchmarks/search_vs_published.py --rows 7 --space full

For each row: the published tp/pp/dp priced by the estimator (micro-batch 1, sequence parallel,
selective recompute, interleaved 1F1B where the layers divide) and the search's best on the
same GPUs and batch, both on the ``a100-nvlink-ib`` preset, with their predicted step times,
the ratio (search / published throughput; never below 1 when the search is right) and whether
the choice fits in memory. ``--space narrow`` keeps the published knobs (ZeRO 0, selective
recompute, 1F1B or interleaved) and micro-batches of 1 or 2, and varies dp x tp x pp and
sequence parallelism; ``full`` searches everything (slow at these sizes).
"""

from __future__ import annotations

import argparse
import sys
import time

from simulator.cost import load_profile
from simulator.estimate import estimate
from simulator.fast_estimate import TraceCache
from simulator.published_configs import NARAYANAN_2021_TABLE_1
from simulator.search import search

NARROW = {
    "zero_stages": (0,),
    "recomputes": ("selective",),
    "schedules": ("1F1B", "Interleaved1F1B"),
    "micro_batch_sizes": (1, 2),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2, help="how many Table 1 rows, smallest first (default 2)")
    p.add_argument("--skip", type=int, default=0, help="start after this many rows (default 0)")
    p.add_argument("--space", choices=["narrow", "full"], default="narrow")
    ns = p.parse_args(argv)
    hw = load_profile("a100-nvlink-ib")
    space = NARROW if ns.space == "narrow" else {}
    print(
        f"{'model':>7} {'GPUs':>5} {'batch':>5} | {'published t,p,d':>15} {'step s':>8} | "
        f"{'search t,p,d,mbs,sched':>26} {'step s':>8} {'fits':>4} | {'ratio':>5} {'s':>6}"
    )
    for row in NARAYANAN_2021_TABLE_1[ns.skip : ns.skip + ns.rows]:
        started = time.perf_counter()
        pub = row.strategy()
        fast = TraceCache(hw).estimate(row.shape(1), pub)
        pub_step = fast.step_time_s if fast is not None else estimate(row.shape(1), pub, hw).step_time_s
        result = search(row.shape(1), row.gpus, row.batch, hw, top_k=1, **space)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        if not result.ranked:
            print(f"{row.billions:>6}B {row.gpus:>5} {row.batch:>5} | nothing fits: {result.advice()}")
            continue
        best = result.ranked[0]
        st = best.strategy
        chosen = (
            f"{st.tp},{st.pp},{st.dp},{best.micro_batch_size},{st.schedule[:5]}{'' if st.chunks == 1 else st.chunks}"
        )
        print(
            f"{row.billions:>6}B {row.gpus:>5} {row.batch:>5} | {f'{row.tp},{row.pp},{row.dp}':>15} {pub_step:>8.3f} | "
            f"{chosen:>26} {best.step_time_s:>8.3f} {'yes' if best.fits else 'no':>4} | "
            f"{pub_step / best.step_time_s:>5.2f} {seconds:>6.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
