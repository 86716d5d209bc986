"""benchmarks/eager_dispatch_cpu.py's ``--ranks`` and ``--copies``: the stand-in step with another
rank count's shapes, and several copies run at once as separate processes, each reported.

No timing is asserted (the machine is shared): only that each copy ran its own measurement of
the step it was asked for and that the summary covers them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "eager_dispatch_cpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(BENCH), "--steps", "1", "--rounds", "1", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_copies_each_report_the_step_and_the_summary_covers_them() -> None:
    done = _run("--copies", "2", "--ranks", "2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "copy 1 of 2:" in out and "copy 2 of 2:" in out and "copy 3 of 2" not in out
    assert out.count("eager step minus hand-written:") == 2
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("TP MLP step as rank 0 of 2, 2 copies at once")


def test_print_json_gives_every_variant_its_cpu_and_bytecodes() -> None:
    done = _run("--print-json", "--ranks", "3")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    variants = {"forward, no tape", "forward", "forward + backward", "eager step", "hand-written"}
    assert set(figures["cpu_s"]) == variants == set(figures["bytecodes"])
    assert all(v > 0 for v in figures["cpu_s"].values())
    # The eager step does the forward and backward and more: its count is the largest.
    assert max(figures["bytecodes"], key=figures["bytecodes"].get) == "eager step"


def test_bad_counts_and_combinations_are_refused_with_the_value() -> None:
    done = _run("--copies", "0")
    assert done.returncode == 2 and "got 4 and 0" in done.stderr
    done = _run("--copies", "2", "--kernels")
    assert done.returncode == 2 and "--copies prints each copy's table" in done.stderr
