"""Seed 003's static program and pipeline Engine program (examples/paddle_auto) under
``mpiexec -n 2`` print the losses of one device (float64, --tiny, 3 steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from mpi_scripts.launch import REPO, mpirun

pytestmark = pytest.mark.mpi
LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)
FLAGS = ["--tiny", "--dtype", "float64", "--steps", "3"]


@pytest.mark.parametrize("script", ["static_single.py", "engine_dp.py", "engine_pp.py"])
def test_paddle_auto_example_under_mpiexec(script: str) -> None:
    path = os.path.join("examples", "paddle_auto", script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    ref = subprocess.run(
        [sys.executable, "-m", "simulator", "--reference", path, *FLAGS],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, cwd=REPO, env=env,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = mpirun(2, path, *FLAGS, env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.output[-3000:]
    want = [float(v) for _, v in LOSS.findall(ref.stdout)]
    got = [float(v) for _, v in LOSS.findall(run.output)]
    assert len(want) == 3 and len(got) == 3
    for a, b in zip(want, got, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a)
