"""Seed 003's static program and pipeline Engine program (examples/paddle_auto) under
``mpiexec -n 2`` print the losses of one device (float64, --tiny, 3 steps); so do its to_static
programs, run in one launch with its single-card program and seed 000 §3."""

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


def test_seed_spelled_examples_under_one_mpiexec() -> None:
    """One launch runs seed 003's single-card program, its three to_static programs and seed 000
    §3 in turn (tests/mpi_scripts/run_examples.py): the to_static programs print the single-card
    losses, and §3 computes relu(A @ B) on both ranks."""
    flags = " ".join(FLAGS)
    names = ["paddle_auto/single.py", *[f"paddle_auto/to_static_{k}.py" for k in ("dp", "mp", "pp")]]
    runs = " -- ".join(f"examples/{name} {flags}" for name in names) + " -- examples/basics/principle.py"
    run = mpirun(2, "tests/mpi_scripts/run_examples.py", *runs.split(), env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, run.output[-3000:]
    sections = re.split(r"^=== (\S+)$", "\n".join(run.lines_of(0)), flags=re.M)[1:]
    out = dict(zip(sections[::2], sections[1::2], strict=True))
    assert list(out) == [f"examples/{name}" for name in names] + ["examples/basics/principle.py"]
    want = [float(v) for _, v in LOSS.findall(out["examples/paddle_auto/single.py"])]
    assert len(want) == 3
    for name in names[1:]:
        got = [float(v) for _, v in LOSS.findall(out[f"examples/{name}"])]
        assert len(got) == 3 and all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(got, want, strict=True)), name
    assert out["examples/basics/principle.py"].strip().splitlines()[-1] == "D: [[19, 22], [43, 50]]"
    assert "D: rank 1: [Replicate()] [[19, 22], [43, 50]]" in run.output  # rank 1 holds D too
