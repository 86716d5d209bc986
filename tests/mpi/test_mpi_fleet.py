"""Paddle fleet under ``mpiexec -n 8``: seed 001's example prints one device's losses.

Eight processes, mp=2, pp=2, sharding=2 (the seed's ``sharding_configs`` spelling): the
tensor-parallel layers' collectives, the pipeline's messages and the sharded optimizer's
reductions and broadcasts all go through the MPI runtime.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from mpi_scripts.launch import mpirun

pytestmark = pytest.mark.mpi

LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
ARGS = ("--tiny", "--dtype", "float64", "--steps", "3")


def test_seed_fleet_example_under_mpiexec_prints_one_devices_losses() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    one = subprocess.run(
        [sys.executable, "examples/fleet/hybrid.py", *ARGS],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=REPO, env={**env, **ENV},
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    run = mpirun(8, "examples/fleet/hybrid.py", *ARGS, env=ENV, timeout=180)
    assert run.returncode == 0, run.output[-3000:]
    want, got = LOSS.findall(one.stdout), LOSS.findall("\n".join(run.lines_of(0)))
    assert len(want) == len(got) == 3, run.output[-3000:]
    for (s1, v1), (s2, v2) in zip(want, got, strict=True):
        assert s1 == s2
        np.testing.assert_allclose(float(v2), float(v1), rtol=1e-9)
    for rank in range(1, 8):
        assert not LOSS.findall("\n".join(run.lines_of(rank)))  # one rank logs
