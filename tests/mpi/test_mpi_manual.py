"""Manual mode under ``mpiexec``: the same collectives and examples as in the simulator.

``tests/mpi_scripts/manual_cases.py`` checks every collective against NumPy on 2, 4 and 8
ranks; the manual examples print one device's step lines; a mismatch (check mode) and a
recv nobody answers (watchdog) end the job with a report in under 15 s.
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

LOSS = re.compile(r"^step (\d+) loss (\S+) acc1 (\S+) acc5 (\S+)", re.M)
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_collective_against_numpy(n: int) -> None:
    run = mpirun(n, "tests/mpi_scripts/manual_cases.py", env=ENV, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    for rank in range(n):
        assert run.lines_of(rank) == ["manual cases ok 171"], run.output[-3000:]


@pytest.mark.parametrize(("kind", "n"), [("dp", 2), ("sharding", 4), ("mp", 2), ("pp", 2)])
def test_manual_examples_print_one_devices_losses(kind: str, n: int) -> None:
    common = ["--tiny", "--dtype", "float64", "--steps", "3"]
    one = subprocess.run(
        [sys.executable, "-m", "simulator", "--reference", f"examples/paddle_auto/primer_{kind}.py", *common],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    run = mpirun(n, f"examples/paddle_manual/{kind}.py", *common, env=ENV, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    want, got = LOSS.findall(one.stdout), LOSS.findall("\n".join(run.lines_of(0)))
    assert len(want) == len(got) == 3, run.output[-3000:]
    for w, g in zip(want, got, strict=True):
        assert w[0] == g[0]
        np.testing.assert_allclose([float(v) for v in g[1:]], [float(v) for v in w[1:]], rtol=1e-9)


def test_a_mismatch_is_reported_under_check_mode() -> None:
    run = mpirun(4, "tests/scripts/manual_mismatch.py", env={**ENV, "MPIPAR_CHECK_COLLECTIVES": "1"}, timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert "ranks [0, 2, 3] issued all_reduce(sum) of float32[4]" in run.output
    assert "rank 1 issued all_gather of float32 pieces [[4], [4], [4], [4]]" in run.output


def test_a_recv_never_answered_is_reported_by_the_watchdog() -> None:
    run = mpirun(3, "tests/scripts/manual_mismatch.py", "--deadlock", env={**ENV, "MPIPAR_TIMEOUT": "2"}, timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert "did not complete within MPIPAR_TIMEOUT=2 s" in run.output
    assert "rank 0 was last seen waiting in recv of float32[4] from rank 2" in run.output


def _span_counts(path: str) -> dict[tuple[int, str, str, str], int]:
    import json
    from collections import Counter

    with open(path, encoding="utf-8") as f:
        spans = json.load(f)["spans"]
    return dict(Counter((s["rank"], s["track"], s["kind"], s["name"]) for s in spans))


@pytest.mark.parametrize("kind", ["dp", "pp"])
def test_measured_timelines_of_simulator_and_mpi_have_the_same_spans(kind: str, tmp_path: object) -> None:
    """Per rank: the same ops and the same collectives/messages, in the simulator as under MPI."""
    sim_path, mpi_path = f"{tmp_path}/sim.json", f"{tmp_path}/mpi.json"
    args = [f"examples/paddle_manual/{kind}.py", "--tiny", "--steps", "2"]
    sim = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", "2", *args], capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL, cwd=REPO, env={**CLEAN, **ENV, "MPIPAR_TRACE": sim_path},
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-3000:]
    run = mpirun(2, *args, env={**ENV, "MPIPAR_TRACE": mpi_path}, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    sim_spans, mpi_spans = _span_counts(sim_path), _span_counts(mpi_path)
    assert sim_spans == mpi_spans
    comm = {k for k in sim_spans if k[1] == "comm"}
    if kind == "dp":
        assert comm == {(r, "comm", "COLL", "all_reduce(avg) on [0, 1]") for r in (0, 1)}
    else:
        assert comm == {(0, "comm", "SEND", "send to 1"), (0, "comm", "RECV", "recv from 1"),
                        (1, "comm", "RECV", "recv from 0"), (1, "comm", "SEND", "send to 0")}  # fmt: skip
