"""Every command refuses unbounded or impossible input on one line, exit status 2, at once.

Each case is input that would otherwise hang, raise a traceback or be silently truncated:
``estimate --params inf`` would never end, ``reshard --mesh 100000x100000`` would allocate
gigabytes, ``--mesh dp=2,dp=2`` would keep the last value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import mpipar as dist
from mpipar import cliargs

BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=ENV)
    done.seconds = time.monotonic() - started  # type: ignore[attr-defined]
    return done


def assert_one_line_refusal(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


SIM = (sys.executable, "-m", "simulator")
MPIPAR = (os.path.join(BIN, "mpipar"),)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ((*SIM, "estimate", "--params", "inf"), ("--params", "'inf'")),
        ((*SIM, "estimate", "--params", "1e30"), ("--params", "limit")),
        ((*SIM, "estimate", "--params", "nan"), ("--params",)),
        ((*SIM, "estimate", "--params", "1e9", "--mesh", "dp=2,dp=2"), ("dp", "twice")),
        ((*SIM, "estimate", "--params", "1e9", "--mesh", "dp=1048576,tp=2"), ("dp(1048576) * tp(2) * pp(1)",)),
        ((*SIM, "estimate", "--params", "1e9", "--plan", "/nonexistent/p.json"), ("--plan", "/nonexistent")),
        ((*SIM, "estimate", "--layers", "2", "--hidden", "64", "--heads", "-4"), ("--heads", "-4")),
        ((*SIM, "schedule", "1F1B", "-p", "2", "-m", "4", "--times", "1,-2,1"), ("--times", "1,-2,1")),
        ((*SIM, "schedule", "1F1B", "-p", "2", "-m", "4", "--times", "1,inf,1"), ("--times",)),
        ((*SIM, "schedule", "1F1B", "-p", "2", "-m", "4", "-o", "/nonexistent/x.json"), ("/nonexistent",)),
        ((*SIM, "-n", "0", "examples/gpt.py"), ("-n", "0")),
        ((*SIM, "-n", "5000", "examples/paddle_manual/dp.py"), ("-n", "5000 per-rank programs", "4096")),
        ((*MPIPAR, "plan", "-o", "/nonexistent/x.json", "examples/gpt.py"), ("/nonexistent",)),
        ((*MPIPAR, "viz", "--port", "99999"), ("--port", "99999")),
        (
            (*MPIPAR, "reshard", "--shape", "4", "4", "--mesh", "100000x100000", "--src", "RR", "--dst", "RR"),
            ("100000 x 100000", "limit"),
        ),
        ((*MPIPAR, "reshard", "--shape", "4", "-4", "--mesh", "2", "--src", "R", "--dst", "R"), ("-4",)),
        (
            (*MPIPAR, "reshard", "--shape", "4", "4", "--mesh", "2", "--src", "R", "--dst", "R", "--dtype", "nope"),
            ("nope",),
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: tuple[str, ...], words: tuple[str, ...]) -> None:
    done = run(*argv)
    assert_one_line_refusal(done, *words)
    assert done.seconds < 30  # type: ignore[attr-defined]


def test_a_mesh_over_the_limit_is_refused_before_any_allocation() -> None:
    with pytest.raises(ValueError, match="over the limit"):
        cliargs.check_world([100000, 100000], "--mesh")
    assert cliargs.check_world([4, 4], "--mesh") == 16


def test_degrees_parse_and_refuse() -> None:
    assert cliargs.parse_degrees("dp=2, tp=4") == {"dp": 2, "tp": 4, "pp": 1}
    for bad in ("dp=2,dp=2", "xp=2", "dp=0", "dp=-1", "dp=2.5", "dp=99999999999999"):
        with pytest.raises(ValueError, match="--mesh"):
            cliargs.parse_degrees(bad)


def test_counts_are_finite_positive_and_bounded() -> None:
    assert cliargs.parse_count("175B") == 175e9
    assert cliargs.parse_count("350m") == 350e6
    for bad in ("inf", "-inf", "nan", "0", "-3", "1e16", "1e400", "x"):
        with pytest.raises(ValueError, match="--params"):
            cliargs.parse_count(bad)


def test_abstract_shapes_are_never_truncated() -> None:
    with pytest.raises(TypeError, match=r"dim 0 is 4\.5"):
        dist.Tensor.abstract((4.5, 4), "float32")
    with pytest.raises(TypeError, match="dim 1 is -1"):
        dist.Tensor.abstract((4, -1), "float32")
    with pytest.raises(TypeError, match="not a sequence"):
        dist.Tensor.abstract("44", "float32")
    assert tuple(dist.Tensor.abstract(np.array([2, 3]), "float32").shape) == (2, 3)
    assert tuple(dist.Tensor.abstract((1 << 40, 1 << 40), "float32").shape) == (1 << 40, 1 << 40)


def test_a_write_failure_after_parsing_is_exit_1(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag named a writable place, and the write fails anyway (disk full): status 1, one line."""
    from mpipar.debug.timeline import Timeline
    from simulator.schedule_sim import main as schedule_main

    def full_disk(self: Timeline, path: str) -> None:
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(Timeline, "save", full_disk)
    target = os.path.join(tmp_path, "t.json")
    assert schedule_main(["1F1B", "-p", "2", "-m", "2", "-o", target]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m simulator schedule: cannot write {target}: No space left on device"], err
