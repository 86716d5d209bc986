"""Faults under MPI end the job promptly with a message, never a hang.

``tests/mpi_scripts/faults.py`` runs a loop of gathers and reductions in which one rank
misbehaves at step 2 (raises, skips a collective, is killed, hangs, or leaves early).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from mpi_scripts.launch import MPIEXEC, mpirun
from processes import run as run_command

pytestmark = pytest.mark.mpi

SCRIPT = "tests/mpi_scripts/faults.py"


def test_a_raising_rank_ends_the_job_with_its_traceback_once() -> None:
    run = mpirun(4, SCRIPT, "raise", "--rank", "1", timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert run.output.count("RuntimeError: boom on rank 1") == 1, run.output
    assert "[rank 1] RuntimeError: boom on rank 1" in run.output
    assert "step 3 done" not in run.output


def test_a_skipped_collective_is_a_clear_mismatch_under_check_mode() -> None:
    run = mpirun(4, SCRIPT, "skip", "--rank", "1", env={"MPIPAR_CHECK_COLLECTIVES": "1"}, timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert run.output.count("CollectiveMismatchError:") == 1, run.output
    assert "members of group [0, 1, 2, 3]" in run.output
    assert "ranks [0, 2, 3] issued all_gather of float64 pieces [[2, 3], [2, 3], [2, 3], [2, 3]]" in run.output
    assert "rank 1 issued all_reduce(sum) of float64[8, 3]" in run.output


def test_a_skipped_collective_without_check_mode_points_at_check_mode() -> None:
    """MPICH's own fatal abort ("Message truncated") is annotated by the stderr sentinel."""
    run = mpirun(4, SCRIPT, "skip", "--rank", "1", timeout=60)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert "step 3 done" not in run.output
    assert "inside a collective" in run.output, run.output
    assert "Rerun with MPIPAR_CHECK_COLLECTIVES=1" in run.output, run.output


def test_a_healthy_run_carries_no_sentinel_hint() -> None:
    run = mpirun(4, SCRIPT, "none", timeout=60)
    assert run.returncode == 0, run.output
    assert "finished" in run.output
    assert "MPIPAR_CHECK_COLLECTIVES" not in run.output


def test_a_killed_rank_ends_the_job() -> None:
    run = mpirun(8, SCRIPT, "kill", "--rank", "3", timeout=90)
    assert run.returncode != 0
    assert run.seconds < 30, run.seconds
    assert "finished" not in run.output


def test_a_timeout_names_the_rank_that_never_arrived() -> None:
    run = mpirun(4, SCRIPT, "hang", "--rank", "2", env={"MPIPAR_TIMEOUT": "2"}, timeout=90)
    assert run.returncode != 0
    assert run.seconds < 20, run.seconds
    assert run.output.count("did not complete within MPIPAR_TIMEOUT=2 s") == 1, run.output
    assert "all_gather on group [0, 1, 2, 3]" in run.output
    assert "never arrived: rank [2]" in run.output
    assert "arrived and waiting: ranks [0, 1, 3]" in run.output


def test_a_rank_leaving_early_fails_its_group_mates_within_seconds() -> None:
    """Default timeout (300 s): the 'exited' notice ends the wait long before it."""
    run = mpirun(4, SCRIPT, "exit", "--rank", "1", timeout=90)
    assert run.returncode != 0
    assert run.seconds < 15, run.seconds
    assert "rank 1 has finished the script (exited) and will not join" in run.output


# ------------------------------------------------------------- agreement by default (no opt-in)
@pytest.mark.parametrize(
    ("mode", "rows", "theirs"),
    [
        ("max", 2, "rank 1 issued all_reduce(max) of float64, 12 elements"),
        ("float32", 2, "rank 1 issued all_reduce(sum) of float32, 24 elements"),
        ("max", 30000, "rank 1 issued all_reduce(max) of float64, 180000 elements"),
    ],
)
def test_a_rank_reducing_differently_is_named_by_default(mode: str, rows: int, theirs: str) -> None:
    """Same bytes, same group: before the default check these finished with exit 0 and
    different "replicated" values (the script is told not to assert them)."""
    run = mpirun(2, SCRIPT, mode, "--rank", "1", "--rows", str(rows), "--no-assert", timeout=60)
    assert run.returncode != 0, run.output
    assert run.seconds < 20, run.seconds
    assert "step 2 done" not in run.output
    assert "CollectiveMismatchError: collective mismatch on group [0, 1]" in run.output, run.output
    assert f"rank 0 issued all_reduce(sum) of float64[{2 * rows}, 3] (call #6 on its group)" in run.output
    assert theirs in run.output


def test_the_default_check_can_be_turned_off() -> None:
    run = mpirun(2, SCRIPT, "max", "--rank", "1", "--no-assert", env={"MPIPAR_AGREE": "off"}, timeout=60)
    assert run.returncode == 0, run.output
    assert "finished" in run.output


def test_a_skipped_large_collective_is_named_within_seconds_not_at_the_timeout() -> None:
    """Rank 1 skips the all-gather of a large tensor: the others wait in it for ever (the default
    timeout is 300 s); the watchdog reads the signature that came with the call instead."""
    run = mpirun(2, SCRIPT, "skip", "--rank", "1", "--rows", "30000", timeout=90)
    assert run.returncode != 0
    assert run.seconds < 20, run.seconds
    assert "collective mismatch on group [0, 1]" in run.output, run.output
    assert "issued all_gather of float64 pieces [[30000, 3], [30000, 3]]" in run.output
    assert "issued all_reduce(sum) of float64" in run.output


def test_settings_that_must_agree_are_compared_at_start_up() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    py = [sys.executable, SCRIPT, "none"]
    start = time.monotonic()
    proc = run_command(
        [MPIEXEC, "-n", "1", "-env", "MPIPAR_TIMEOUT", "30", *py, ":", "-n", "1", *py], env=env, timeout=60
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert time.monotonic() - start < 20
    assert "mpipar settings differ between ranks (MPIPAR_TIMEOUT: rank 0 has 30.0, rank 1 has 300.0)" in output, output
    assert "step 0 done" not in output
