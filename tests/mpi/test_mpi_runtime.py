"""The MPI runtime against the simulator: same shards bit for bit, same recorded communication.

Each test launches ``mpiexec -n 2/4/8`` (the mpich wheel) on a script in ``tests/mpi_scripts``
that runs many seeded random cases and compares, in-process, every rank's result with the
simulator's (see the scripts' docstrings); the reshard and communicator cases of one world size
share a launch. Run just these with ``pytest -m mpi``.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
from mpi_scripts.launch import REPO, Run, mpirun

pytestmark = pytest.mark.mpi

RESHARD_CASES = {2: 150, 4: 150, 8: 120}
"""Seeded reshard cases per world size (``reshard_cases.py``); 200 communicator cases at each."""


@functools.cache
def _cases_run(n: int) -> tuple[Run, list[list[str]]]:
    """``reshard_cases.py`` then ``comm_cases.py`` in one ``mpiexec -n n`` (``run_examples.py``
    runs them in turn): the run, and rank 0's lines of each script."""
    run = mpirun(
        n,
        "tests/mpi_scripts/run_examples.py",
        *("tests/mpi_scripts/reshard_cases.py", "--cases", str(RESHARD_CASES[n]), "--seed", "20"),
        "--",
        *("tests/mpi_scripts/comm_cases.py", "--cases", "200", "--seed", "22"),
        timeout=600,
    )
    sections = re.split(r"^=== .*$", "\n".join(run.lines_of(0)), flags=re.M)[1:]
    return run, [section.strip().splitlines() for section in sections]


@pytest.mark.parametrize(("n", "cases"), RESHARD_CASES.items())
def test_reshard_cases_match_simulator(n: int, cases: int) -> None:
    run, (reshard, _) = _cases_run(n)
    assert run.returncode == 0, run.output[-4000:]
    assert reshard[-1] == f"ok {cases} cases on {n} ranks"


def test_reshard_cases_under_check_mode() -> None:
    """The signature check finds no mismatch in correct plans (and costs no correctness)."""
    run = mpirun(
        6, "tests/mpi_scripts/reshard_cases.py", "--cases", "80", "--seed", "21", env={"MPIPAR_CHECK_COLLECTIVES": "1"}
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1] == "ok 80 cases on 6 ranks"


@pytest.mark.parametrize("n", list(RESHARD_CASES))
def test_communicator_methods_match_simulator(n: int) -> None:
    run, (_, comm) = _cases_run(n)
    assert run.returncode == 0, run.output[-4000:]
    assert comm[-1] == f"ok 200 cases on {n} ranks"


@pytest.mark.parametrize("n", [3, 8])
def test_native_sums_match_the_simulator_to_rounding(n: int) -> None:
    """MPIPAR_REDUCE=native: float sums by MPI itself, within rounding; all else bit for bit."""
    run = mpirun(
        n, "tests/mpi_scripts/comm_cases.py", "--cases", "200", "--seed", "23", env={"MPIPAR_REDUCE": "native"}
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.lines_of(0)[-1] == f"ok 200 cases on {n} ranks"


def test_a_bad_reduce_mode_is_refused() -> None:
    run = mpirun(2, "tests/mpi_scripts/comm_cases.py", "--cases", "1", env={"MPIPAR_REDUCE": "fast"})
    assert run.returncode != 0
    assert "MPIPAR_REDUCE='fast' is not one of ordered, native" in run.output


def _simulated(script: str, n: int) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", str(n), script],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return out.splitlines()


@pytest.mark.parametrize(("script", "n"), [("examples/basics/reshard.py", 8), ("examples/basics/shard_tensor.py", 6)])
def test_examples_print_the_simulators_shards(script: str, n: int) -> None:
    """No flags, no environment: each rank prints its shard; together they are the simulator's lines."""
    run = mpirun(n, script)
    assert run.returncode == 0, run.output
    lines = run.output.splitlines()
    for line in lines:  # a line about rank r comes from rank r, prefixed unless r == 0
        m = re.search(r"rank (\d+)", re.sub(r"^\[rank \d+\] ", "", line))
        assert m, line
        r = int(m.group(1))
        assert line.startswith(f"[rank {r}] ") if r else not line.startswith("[rank"), line
    got = sorted(re.sub(r"^\[rank \d+\] ", "", line) for line in lines)
    assert got == sorted(_simulated(script, n))


def test_print_once_prints_on_rank_zero_only() -> None:
    run = mpirun(4, "tests/mpi_scripts/faults.py", "none", "--steps", "3")
    assert run.returncode == 0, run.output
    assert run.output.splitlines() == ["step 0 done", "step 1 done", "step 2 done", "finished"]


def test_a_mesh_larger_than_the_world_is_refused_once_on_every_rank() -> None:
    """The (2, 3) mesh of seed_shard_tensor names ranks 0..5: with 4 processes every rank
    refuses it; the report shows once and the job ends."""
    run = mpirun(4, "examples/basics/shard_tensor.py", timeout=60)
    assert run.returncode != 0
    assert (
        run.output.count("ValueError: ProcessMesh [2, 4, 5, 0, 1, 3] names process 4, but the world has 4 ranks") == 1
    ), run.output
    assert "mpiexec -n 6" in run.output


@pytest.mark.parametrize("n", [2, 4])
def test_results_stay_intact_while_their_buffers_are_reused(n: int) -> None:
    """Kept results (arrays, views, memoryviews) never change; dropped ones' buffers come back."""
    run = mpirun(n, "tests/mpi_scripts/result_reuse.py", "--rounds", "12")
    assert run.returncode == 0, run.output[-4000:]
    assert re.fullmatch(r"ok 12 rounds, [1-9]\d* reuses", run.lines_of(0)[-1]), run.output[-2000:]


def test_backward_replay_is_bit_identical_under_mpi() -> None:
    """A replayed backward pass (``mpipar.backward_replay``) gives every loss, parameter, state and
    collective of the eager pass, bit for bit, with tensor, data (bucketed reductions) and 2-D
    parallelism; every pass after the two recordings is replayed."""
    run = mpirun(4, "tests/mpi_scripts/backward_replay.py", "--steps", "6")
    assert run.returncode == 0, run.output[-4000:]
    for rank in range(4):
        assert run.lines_of(rank)[-3:] == ["ok tp replayed 4", "ok dp replayed 4", "ok block replayed 4"], run.output[
            -2000:
        ]
