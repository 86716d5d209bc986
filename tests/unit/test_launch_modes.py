"""The launch modes: plain python, python -m simulator -n N, and --reference (the oracle)."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from conftest import REPO
from processes import environ, run_python

import mpipar as dist
from simulator import ReferenceBackend

TOUR = os.path.join(REPO, "tests", "scripts", "reshard_tour.py")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=environ(drop=("MPIPAR_BACKEND",)), timeout=120)


def test_plain_python_hosts_every_rank() -> None:
    out = _run(TOUR)
    assert out.returncode == 0, out.stderr
    assert "backend sim world 8 rank 0" in out.stdout
    assert "equal True" in out.stdout
    assert "'send'" in out.stdout and "'all_to_all'" in out.stdout


def test_simulator_fixed_world() -> None:
    out = _run("-m", "simulator", "-n", "8", TOUR)
    assert out.returncode == 0, out.stderr
    assert "backend sim world 8 rank 0" in out.stdout and "equal True" in out.stdout


def test_simulator_world_too_small_is_a_clear_error() -> None:
    out = _run("-m", "simulator", "-n", "6", TOUR)
    assert out.returncode != 0
    assert "names process 6, but the world has 6 ranks" in out.stderr


def test_reference_mode_records_no_communication() -> None:
    out = _run("-m", "simulator", "--reference", TOUR)
    assert out.returncode == 0, out.stderr
    assert "backend reference" in out.stdout
    assert "equal True" in out.stdout
    assert "counts {}" in out.stdout


def test_reference_tensors_are_one_dense_array() -> None:
    with dist.use_backend(ReferenceBackend()):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]])
        value = np.arange(12.0).reshape(4, 3)
        with dist.CommDebugMode() as comm:
            t = dist.shard_tensor(value, mesh, [dist.Shard(0), dist.Partial()])
            u = dist.reshard(t, dist.ProcessMesh([5, 6]), [dist.Shard(1)])
            full = u.full_tensor()
        assert comm.events == []
        # one big device: every "local" view is the whole global array
        np.testing.assert_array_equal(t.local_tensor(3), value)
        np.testing.assert_array_equal(full, value)
        assert u.placements == [dist.Shard(1)]  # the labels the script asked for are kept


def test_reference_communicator_refuses_any_call() -> None:
    with dist.use_backend(ReferenceBackend()), pytest.raises(RuntimeError, match="--reference"):
        dist.current_backend().comm.all_reduce((0, 1), {0: np.zeros(2), 1: np.zeros(2)}, "sum")


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        ("basics/shard_tensor.py", (), "rank 1 coord (1, 1): local shape [2, 1] [[8], [11]]"),
        ("basics/reshard.py", (), "after: rank 3: [[4, 5, 6]]"),
    ],
)
@pytest.mark.parametrize("mode", [(), ("-m", "simulator", "-n", "6"), ("-m", "simulator", "--reference")])
def test_seed_examples_in_every_mode(script: str, args: tuple[str, ...], expect: str, mode: tuple[str, ...]) -> None:
    path = os.path.join(REPO, "examples", script)
    out = _run(*mode, path, *args) if mode else _run(path, *args)
    assert out.returncode == 0, out.stderr
    if "--reference" in mode:
        assert "one big device" in out.stdout
    else:
        assert expect in out.stdout
