"""How fast the search ranks the whole space, row by row: every model of Narayanan et al. 2021
Table 1 (1.7B on 32 A100s to 1T on 3072) and Llama 3 405B on 16,384 H100s.

    python benchmarks/search_speed.py                 # the table
    python benchmarks/search_speed.py --print-json    # the rows as one JSON object
    python benchmarks/search_speed.py --json PATH     # the table, also kept as a results record
    python benchmarks/search_speed.py --rows 0,10     # some rows only
    python benchmarks/search_speed.py --traced        # GPT-3 175B on 1024 A100s through the traced search

Each row runs ``simulator.family_search.search_family`` (what ``python -m simulator search
--model ...`` runs) on the row's devices and global batch with the full space (every dp x cp x
tp x pp that divides, every micro-batch size, 1F1B and interleaved, recompute, ZeRO 1-3,
overlap) and prints wall and CPU seconds, the candidates enumerated and priced, and the best
layout. On a shared machine the wall clock measures the neighbours as much as the search: the
load average is printed at the start and the end, and CPU seconds beside the wall.
``--traced`` times the traced search (``simulator.search``) instead, as before. ``--json PATH``
writes what is printed to a results record (``benchmarks/results.py``), as every benchmark does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from results import add_json_argument, record

from simulator.cost import load_profile
from simulator.family import ModelShape, preset
from simulator.family_search import search_family
from simulator.published_configs import NARAYANAN_2021_TABLE_1
from simulator.search import _progress_bar, search
from simulator.step_trace import GPTShape


def rows() -> list[tuple[str, ModelShape, int, int, str]]:
    out = [
        (f"GPT {r.billions}B", ModelShape(r.layers, r.hidden, r.heads, 2048, 51200), r.gpus, r.batch, "a100-sxm")
        for r in NARAYANAN_2021_TABLE_1
    ]
    out.append(("Llama 3 405B", preset("llama3-405b"), 16384, 2048, "h100-sxm"))
    return out


def traced(ns: argparse.Namespace) -> int:
    shape = GPTShape(96, 12288, 96, 2048, 51200)
    hw = load_profile("a100-nvlink-ib")
    started, cpu = time.perf_counter(), time.process_time()
    result = search(shape, 1024, 1536, hw, top_k=3, progress=_progress_bar)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(
        f"traced search, GPT-3 175B on 1024 A100s: {result.enumerated} candidates, {seconds:.1f} s wall, {cpu:.1f} s CPU"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row numbers (default: all 11)")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--print-json", action="store_true", help="print the rows as one JSON object instead of the table")
    p.add_argument("--traced", action="store_true", help="time the traced search on GPT-3 175B instead")
    add_json_argument(p)
    ns = p.parse_args(argv)
    record(ns.json, __file__)
    if ns.traced:
        return traced(ns)
    todo = rows()
    if ns.rows:
        todo = [todo[int(i)] for i in ns.rows.split(",")]
    load_start = os.getloadavg()
    out = []
    for name, shape, devices, batch, hardware in todo:
        started, cpu = time.perf_counter(), time.process_time()
        result = search_family(shape, devices, batch, hardware, top_k=ns.top)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        best = result.ranked[0] if result.ranked else None
        out.append(
            {
                "row": name,
                "devices": devices,
                "global_batch": batch,
                "hardware": hardware,
                "wall_s": seconds,
                "cpu_s": cpu,
                "enumerated": result.enumerated,
                "priced": result.priced,
                "best": best.describe() if best else None,
                "best_step_time_s": best.step_time_s if best else None,
                "best_mfu": best.mfu if best else None,
            }
        )
        if not ns.print_json:
            print(
                f"{name:>14} {devices:>6} devices batch {batch:>5}: {seconds:6.1f} s wall {cpu:6.1f} s CPU, "
                f"{result.enumerated:>7} candidates, {result.priced:>5} priced; best "
                + (f"{best.describe()}, {best.step_time_s:.3f} s, MFU {best.mfu:.1%}" if best else "none fits"),
                flush=True,
            )
    load_end = os.getloadavg()
    if ns.print_json:
        json.dump({"load_average_start": load_start, "load_average_end": load_end, "rows": out}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(
            "load average (1, 5, 15 min) at the start: "
            + ", ".join(f"{x:.1f}" for x in load_start)
            + "; at the end: "
            + ", ".join(f"{x:.1f}" for x in load_end)
            + f"; slowest row {max(r['wall_s'] for r in out):.1f} s wall"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
