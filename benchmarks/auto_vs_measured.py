"""Is ``examples/gpt.py --auto`` at 8 ranks within 10% of the fastest layout, measured?

    .venv/bin/python benchmarks/auto_vs_measured.py [--profile profile.json] [--steps 8] [--rounds 3] [--json PATH]

1. **Calibrate** this machine once (``python -m simulator calibrate -n 8``; ``--profile`` reuses a
   profile file): links, the GEMM and elementwise rates by size, mpipar's host costs and the
   kernel scale of a training step -- the one CPU model ``--auto``, ``estimate`` and the
   dashboard price with.
2. **Predict**: the search ``--auto`` runs (``simulator.auto.choose``: gpt.py's default model,
   8 ranks, global batch 16, on that profile) with every fitting candidate kept, and the best
   candidate of each valid ``(dp, tp, pp)`` (``dp * tp * pp = 8``, heads % tp, layers % pp,
   batch % dp: gpt.py's default model has 4 heads, 4 layers, batch 16) with its predicted step.
3. **Measure** under ``mpiexec -n 8`` each layout with the flags of its best candidate (what
   ``--auto`` would run had it picked that layout) and ``gpt.py --auto --profile`` itself:
   seconds per step = median gap between step lines after the first
   (``benchmarks/predict_vs_measure.measure``). Rounds are interleaved (each run once per
   round, the order rotated each round: ``predict_vs_measure.interleaved``) and each run keeps its best round, so a neighbour's burst on a
   shared machine spoils one round, not one layout.
4. Print the table (layout, flags, predicted and measured seconds, rank by each), the rank
   correlation (Spearman) of the predicted and measured orders, the auto choice, the fastest
   measured and auto / fastest: PASS when at most 1.10 (where ``--auto`` chose exactly a row's
   flags, its step is the best of its own run and the row's: one command measured twice), then the same as one JSON object on a
   ``result:`` line (rows, correlation, ratio, verdict, load averages, the profile's kernel
   scale); ``--json PATH`` records the run (``benchmarks/results.py``).

On the project's shared 2-core machine 8 ranks time-share two cores; steps take seconds and
the load of other jobs moves them. About 10 minutes on a quiet machine with the defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from predict_vs_measure import interleaved, measure  # noqa: E402
from results import add_json_argument, record  # noqa: E402

WORLD, BATCH, LAYERS = 8, 16, 4
CHOSE = re.compile(r"^auto: chose +(.+?)  \(predicted step ([\d.]+) ms\)$")
PASS_RATIO = 1.10


@dataclass
class Row:
    layout: str
    """``dp=..,tp=..,pp=..``."""
    flags: list[str]
    """gpt.py flags of the layout's best candidate, ``--mesh`` included."""
    predicted_s: float
    measured_s: float = float("inf")
    spread_s: float = 0.0


def layout_of(flags: list[str]) -> str:
    """``dp=..,tp=..,pp=..`` of a gpt.py flag list's ``--mesh``."""
    if "--mesh" not in flags:
        raise ValueError(f"no --mesh in {flags!r}")
    return flags[flags.index("--mesh") + 1]


def gpt_module() -> Any:
    """examples/gpt.py as a module: its ``auto_flags`` and ``flag_text`` turn a searched candidate
    into the flags ``--auto`` runs (the same code, so a layout is measured as --auto would run it)."""
    examples = os.path.join(ROOT, "examples")
    sys.path.insert(0, examples)  # gpt.py imports its sibling ``common``
    spec = importlib.util.spec_from_file_location("mpipar_example_gpt", os.path.join(examples, "gpt.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def predicted_layouts(profile_path: str) -> list[Row]:
    """The best searched candidate of every valid (dp, tp, pp), as gpt.py flags, fastest first."""
    from simulator.auto import choose
    from simulator.cost import load_profile
    from simulator.step_trace import GPTShape

    shape = GPTShape(LAYERS, 128, 4, 64, 128, 1, 0.0)  # gpt.py's default model (its auto_search)
    gpt = gpt_module()
    result = choose(shape, WORLD, BATCH, load_profile(profile_path), top_k=100_000, grad_clip=gpt.GRAD_CLIP_NORM)
    best: dict[str, Row] = {}
    for cand in result.ranked:  # fastest first: the first of a layout is its best
        st = cand.strategy
        layout = f"dp={st.dp},tp={st.tp},pp={st.pp}"
        if layout not in best:
            best[layout] = Row(
                layout, shlex.split(gpt.flag_text(gpt.auto_flags(cand, LAYERS, BATCH))), cand.step_time_s
            )
    return sorted(best.values(), key=lambda r: r.predicted_s)


def valid_layouts() -> list[str]:
    """Every (dp, tp, pp) of 8 ranks gpt.py's default model divides into."""
    heads, layers = 4, LAYERS
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if WORLD % (tp * pp) or heads % tp or layers % pp:
                continue
            dp = WORLD // (tp * pp)
            if BATCH % dp == 0:
                out.append(f"dp={dp},tp={tp},pp={pp}")
    return out


def auto_step_of(own_s: float, flags: list[str], rows: list[Row]) -> tuple[float, Row | None]:
    """``--auto``'s measured step and the row whose flags it chose exactly, if any: then the
    row's runs and ``--auto``'s are one command measured twice (the search before the first step
    is not timed) and its step is the best of both, as each run keeps its best round, so one
    noisy ``--auto`` run cannot fail the check alone."""
    same = next((r for r in rows if r.flags == flags), None)
    return (min(own_s, same.measured_s) if same is not None else own_s), same


def rank_of(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = r + 1
    return ranks


def rank_correlation(a: list[int], b: list[int]) -> float:
    """Spearman's rho of two rankings without ties: 1 - 6 sum(d^2) / (n (n^2 - 1)); 1 for n < 2."""
    n = len(a)
    if n < 2:
        return 1.0
    return 1.0 - 6.0 * sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a calibrated profile JSON to reuse (default: calibrate -n 8 now)")
    parser.add_argument("--steps", type=int, default=8, help="gpt.py steps per run (the first is excluded; at least 3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each run keeps its best")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before one gpt.py run is killed")
    add_json_argument(parser)
    ns = parser.parse_args()
    if ns.steps < 3 or ns.rounds < 1:
        parser.error(f"--steps must be >= 3 and --rounds >= 1, got {ns.steps} and {ns.rounds}")
    record(ns.json, __file__)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    if ns.profile:
        path = os.path.abspath(ns.profile)
    else:
        path = os.path.join(tempfile.mkdtemp(prefix="mpipar-calibrate-"), "profile.json")
        subprocess.run(
            [sys.executable, "-m", "simulator", "calibrate", "-n", str(WORLD), "-o", path],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            timeout=600,
        )
        print(f"calibrated (mpiexec -n {WORLD}): {path}")
    from simulator.auto import has_cpu_model
    from simulator.cost import load_profile

    profile = load_profile(path)
    if not has_cpu_model(profile):
        print(f"warning: {path} has no kernel probe (calibrated before it); --auto would measure again")
    print(f"profile {profile.name}: kernel_scale {profile.kernel_scale:.2f}")
    rows = predicted_layouts(path)
    searched = {r.layout for r in rows}
    missing = [lay for lay in valid_layouts() if lay not in searched]
    if missing:
        print(f"note: no fitting searched candidate for {', '.join(missing)} (skipped)")
    print(
        f"{len(rows)} layouts, {ns.rounds} round(s) of {ns.steps} steps each, plus --auto; load average {load:.1f}",
        flush=True,
    )
    auto = Row("--auto", ["--auto", "--profile", path], float("nan"))
    auto_lines: list[str] = []
    by_name = {row.layout: row for row in [*rows, auto]}

    def run(name: str, round_: int) -> float:
        nonlocal auto_lines
        row = by_name[name]
        lines: list[str] = []
        flags = row.flags if row is auto else row.flags[2:]
        m, sp = measure(None if row is auto else row.layout, ns.steps, tuple(flags), lines, ns.timeout)
        if m < row.measured_s:
            row.measured_s, row.spread_s = m, sp
        if row is auto:
            auto_lines = lines
        print(f"  round {round_ + 1}: {row.layout:<16} {m:.4f} s/step", flush=True)
        return m

    interleaved(list(by_name), ns.rounds, run)
    chosen = next((CHOSE.match(line) for line in auto_lines if CHOSE.match(line)), None)
    if chosen is None:
        raise SystemExit("gpt.py --auto printed no 'auto: chose' line:\n" + "\n".join(auto_lines[-20:]))
    auto_flags_ = shlex.split(chosen.group(1))
    auto.layout = layout_of(auto_flags_)
    auto.predicted_s = float(chosen.group(2)) / 1e3
    pred_rank = rank_of([r.predicted_s for r in rows])
    meas_rank = rank_of([r.measured_s for r in rows])
    print(f"\n{'layout':<16} {'predicted s':>11} {'measured s':>10} {'+-':>6} {'rank pred':>9} {'rank meas':>9}  flags")
    for row, rp, rm in zip(rows, pred_rank, meas_rank, strict=True):
        print(
            f"{row.layout:<16} {row.predicted_s:>11.4f} {row.measured_s:>10.4f} {row.spread_s:>6.3f} {rp:>9} {rm:>9}  "
            f"{' '.join(row.flags)}"
        )
    print(
        f"{'--auto':<16} {auto.predicted_s:>11.4f} {auto.measured_s:>10.4f} {auto.spread_s:>6.3f} {'':>9} {'':>9}  "
        f"chose {' '.join(auto_flags_)}"
    )
    fastest = min(rows, key=lambda r: r.measured_s)
    auto_step, same = auto_step_of(auto.measured_s, auto_flags_, rows)
    if same is not None:
        print(
            f"--auto ran the {same.layout} row's own flags: its step is the best of both runs' "
            f"({auto.measured_s:.4f} s, {same.measured_s:.4f} s)"
        )
    ratio = auto_step / fastest.measured_s
    rho = rank_correlation(pred_rank, meas_rank)
    print(
        f"rank correlation of predicted and measured orders (Spearman): {rho:.2f} over {len(rows)} layouts (aim >= 0.7)"
    )
    print(
        f"\nauto chose {auto.layout} (predicted rank {next((p for r, p in zip(rows, pred_rank, strict=True) if r.layout == auto.layout), '?')}); "
        f"fastest measured {fastest.layout} {fastest.measured_s:.4f} s; auto measured {auto_step:.4f} s"
    )
    load_end = os.getloadavg()[0]
    print(
        f"auto / fastest = {ratio:.3f}: {'PASS' if ratio <= PASS_RATIO else 'FAIL'} (<= {PASS_RATIO:.2f}); "
        f"load average {load:.1f} at the start, {load_end:.1f} at the end, {time.perf_counter() - started:.0f} s"
    )
    print(
        "result: "
        + json.dumps(
            {
                "layouts": [
                    {
                        "layout": r.layout,
                        "flags": r.flags,
                        "predicted_s": r.predicted_s,
                        "measured_s": r.measured_s,
                        "spread_s": r.spread_s,
                        "rank_predicted": rp,
                        "rank_measured": rm,
                    }
                    for r, rp, rm in zip(rows, pred_rank, meas_rank, strict=True)
                ],
                "auto": {
                    "layout": auto.layout,
                    "predicted_s": auto.predicted_s,
                    "measured_s": auto_step,
                    "own_run_s": auto.measured_s,
                    "same_flags_as_row": same is not None,
                },
                "fastest": fastest.layout,
                "auto_over_fastest": ratio,
                "pass": ratio <= PASS_RATIO,
                "rank_correlation": rho,
                "kernel_scale": profile.kernel_scale,
                "load_average_start": load,
                "load_average_end": load_end,
                "cpus": os.cpu_count(),
                "steps": ns.steps,
                "rounds": ns.rounds,
                "seconds": time.perf_counter() - started,
            }
        )
    )


if __name__ == "__main__":
    main()
