"""Reorganising modules changes no number.

The losses the seed examples and ``gpt.py --steps 3`` print under the simulator were recorded
into ``golden/example_losses.json`` (``python tests/unit/test_golden_losses.py --record``); moving
modules must leave them the same strings. float32 is the default dtype, so the 15 significant digits
``log_step`` prints hold every bit of each loss.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(REPO, "tests", "golden", "example_losses.json")
LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)

# (name in the golden, script, extra flags, ranks). One world of 8 for every case: the seeds' meshes fit it.
CASES: list[tuple[str, str, list[str], int]] = [
    ("seed_dp", "paddle_auto/dp.py", [], 8),
    ("seed_tp", "paddle_auto/tp.py", [], 8),
    ("seed_pp", "paddle_auto/pp.py", [], 8),
    ("seed_hybrid", "paddle_auto/hybrid.py", [], 8),
    ("gpt_dp2_tp2_pp2", "gpt.py", ["--mesh", "dp=2,tp=2,pp=2"], 8),
    ("gpt_tp4_sp_zero2", "gpt.py", ["--mesh", "dp=2,tp=4", "--sequence-parallel", "--zero", "2"], 8),
]


def losses_of(script: str, extra: list[str], n: int) -> list[str]:
    """The loss strings one simulated run prints, exactly as printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPIPAR_BACKEND", "MPIPAR_TRACE")}
    cmd = [
        sys.executable,
        "-m",
        "simulator",
        "-n",
        str(n),
        os.path.join("examples", script),
        "--tiny",
        "--steps",
        "3",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    found = [v for _, v in LOSS.findall(out.stdout)]
    assert len(found) == 3, out.stdout[-2000:]
    return found


@pytest.mark.parametrize(("name", "script", "extra", "n"), CASES, ids=[c[0] for c in CASES])
def test_losses_are_the_recorded_ones(name: str, script: str, extra: list[str], n: int) -> None:
    with open(GOLDEN, encoding="utf-8") as f:
        golden = json.load(f)
    assert losses_of(script, extra, n) == golden[name]


def record() -> None:
    golden = {name: losses_of(script, extra, n) for name, script, extra, n in CASES}
    with open(GOLDEN, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit("usage: python tests/unit/test_golden_losses.py --record")
    record()
