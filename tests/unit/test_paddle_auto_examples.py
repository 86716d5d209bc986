"""The seed 003 static-graph examples (examples/paddle_auto): one device, virtual ranks and
per-rank programs print the same losses (float64, --tiny, 3 steps); tests/mpi has MPI's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)
EXAMPLES = ["static_single.py", "engine_dp.py", "engine_sharding.py", "engine_pp.py"]
FLAGS = ["--tiny", "--dtype", "float64", "--steps", "3"]


def _losses(cmd: list[str]) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("MPIPAR_BACKEND", "MPIPAR_TRACE")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return [float(v) for _, v in LOSS.findall(out.stdout)]


@pytest.mark.parametrize("script", EXAMPLES)
def test_seed_example_runs_as_one_device(script: str) -> None:
    path = os.path.join("examples", "paddle_auto", script)
    ref = _losses([sys.executable, "-m", "simulator", "--reference", path, *FLAGS])
    sim = _losses([sys.executable, "-m", "simulator", "-n", "2", path, *FLAGS])
    assert len(ref) == 3 and sim == ref


@pytest.mark.parametrize("script", ["static_single.py", "engine_pp.py"])
def test_seed_example_per_rank(script: str) -> None:
    """One program per rank, in threads of the simulator: each rank builds its own static program."""
    path = os.path.join("examples", "paddle_auto", script)
    ref = _losses([sys.executable, "-m", "simulator", "--reference", path, *FLAGS])
    per_rank = _losses([sys.executable, "-m", "simulator", "-n", "2", "--per-rank", path, *FLAGS])
    assert len(ref) == 3 and per_rank == ref


def test_seed_model_parallel_engine_example() -> None:
    path = os.path.join("examples", "paddle_auto", "engine_mp.py")
    ref = _losses([sys.executable, "-m", "simulator", "--reference", path, *FLAGS])
    assert _losses([sys.executable, "-m", "simulator", "-n", "2", path, *FLAGS]) == ref
