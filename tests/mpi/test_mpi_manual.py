"""Manual mode under ``mpiexec``: the same collectives and examples as in the simulator.

``tests/mpi_scripts/manual_cases.py`` checks every collective against NumPy on 2, 4 and 8
ranks; seed 003's fleet examples print the simulator's step lines (and one device's); a mismatch (check mode) and a
recv nobody answers (watchdog) end the job with a report in under 15 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from mpi_scripts.launch import mpirun

pytestmark = pytest.mark.mpi

LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)
COMMON = ("--tiny", "--dtype", "float64", "--steps", "3")
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_collective_against_numpy(n: int) -> None:
    run = mpirun(n, "tests/mpi_scripts/manual_cases.py", env=ENV, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    for rank in range(n):
        assert run.lines_of(rank) == ["manual cases ok 171"], run.output[-3000:]


@pytest.fixture(scope="module")
def single_card() -> list[str]:
    """Seed 003 §2.1.1 (one device): the losses its fleet data-parallel, group-sharded and
    model-parallel programs print when every process seeds NumPy alike."""
    one = subprocess.run(
        [sys.executable, "examples/paddle_auto/single.py", *COMMON],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=REPO, env={**CLEAN, **ENV},
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    return LOSS.findall(one.stdout)


@pytest.mark.parametrize("kind", ["dp", "sharding", "mp", "pp"])
def test_seed_fleet_examples_print_the_simulators_losses(kind: str, single_card: list[str]) -> None:
    """Seed 003's fleet programs as written, on 2 processes: the per-rank simulator's step lines
    (each rank its own NumPy generator, as a process); data parallel, ZeRO-3 and model parallel
    also the single-card program's (a pipeline builds each stage's weights on its own rank)."""
    path = f"examples/paddle_manual/{kind}.py"
    sim = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", "2", path, *COMMON],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=REPO, env={**CLEAN, **ENV},
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-3000:]
    run = mpirun(2, path, *COMMON, env=ENV, timeout=120)
    assert run.returncode == 0, run.output[-3000:]
    got = LOSS.findall("\n".join(run.lines_of(0)))
    assert len(got) == 3 and got == LOSS.findall(sim.stdout), run.output[-3000:]
    if kind != "pp":
        for (step, g), (want_step, w) in zip(got, single_card, strict=True):
            assert step == want_step and abs(float(g) - float(w)) <= 1e-9 * abs(float(w))


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
        # the stages exchange activations and gradients; the last stage broadcasts the loss
        assert comm == {(0, "comm", "SEND", "send to 1"), (0, "comm", "RECV", "recv from 1"),
                        (1, "comm", "RECV", "recv from 0"), (1, "comm", "SEND", "send to 0"),
                        (0, "comm", "COLL", "broadcast(root 1) on [0, 1]"), (1, "comm", "COLL", "broadcast(root 1) on [0, 1]")}  # fmt: skip
