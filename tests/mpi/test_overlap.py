"""Overlapped gradient reduction (``dist.overlap_grad_reduction``): bit-identical losses and
parameters with and without it, the same all-reduce bytes in as many collectives as buckets,
and bucket reductions started while backward still runs; in the simulator, under ``mpiexec``
(one launch for every layout and size) and through the NCCL stand-in. The training steps live in
``tests/mpi_scripts/overlap_step.py``."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
from mpi_scripts.launch import REPO, Run, mpirun
from mpi_scripts.overlap_step import digest, run, started_cases
from test_nccl_standin import NCCL_ENV

import mpipar as dist

LARGE = ("--hidden", "67", "--inner", "1100", "--bucket-mib", "1")
"""Gradients of 0.6 MiB: the all-to-all + all-gather path (uneven ranges too), where the blocking
reduction folds pieces as they arrive; small ones gather whole buffers."""


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_overlap_gives_the_same_bits_and_bytes_in_the_simulator(layout: str) -> None:
    plain = run(layout, overlap=False)
    over = run(layout, overlap=True)
    one = run(layout, overlap=True, bucket_mib=0.0)
    assert plain["losses"] == over["losses"] == one["losses"]
    assert digest(plain) == digest(over) == digest(one)
    assert plain["bytes"] == over["bytes"] == one["bytes"]
    # One bucket per gradient: exactly the collectives of the usual path; buckets: fewer.
    assert one["counts"] == plain["counts"]
    assert over["counts"]["all_reduce"] < plain["counts"]["all_reduce"]
    # Every bucketed gradient's all-reduce became part of one bucket's.
    n_over, n_one = _starts(over["events"]), _starts(one["events"])
    assert n_over >= 2 and n_one > n_over
    assert over["counts"]["all_reduce"] == plain["counts"]["all_reduce"] - n_one + n_over


def _starts(events: list[tuple[object, ...]]) -> int:
    return sum(1 for e in events if e[0] == "start")


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_first_bucket_starts_before_backward_ends(layout: str) -> None:
    events = run(layout, overlap=True)["events"]
    kinds = [e[0] for e in events]
    first_start = kinds.index("start")
    last_op = len(kinds) - 1 - kinds[::-1].index("op")
    assert first_start < last_op, events
    assert kinds[-1] == "wait" or kinds.index("wait") > last_op


def test_reduce_scattered_gradients_take_the_usual_path() -> None:
    plain = run("dp", overlap=False, zero=2)
    over = run("dp", overlap=True, zero=2)
    assert digest(plain) == digest(over) and plain["counts"] == over["counts"] and plain["bytes"] == over["bytes"]
    assert plain["counts"].get("reduce_scatter", 0) > 0
    assert _starts(over["events"]) == 0  # ZeRO-2 reduce-scatters: nothing to bucket


def test_started_all_reduce_matches_the_blocking_one_in_the_simulator() -> None:
    dist.ProcessMesh(list(range(4)))
    cases, kinds = started_cases()
    assert cases > 100 and kinds == ["Completed"]  # the simulator's communicator: the blocking fallback


def test_bucket_size_is_validated() -> None:
    for bad in (-1, float("nan"), float("inf"), "4", True):
        with pytest.raises(ValueError, match="bucket_mib"):
            dist.overlap_grad_reduction(bucket_mib=bad)  # type: ignore[arg-type]


def test_nothing_is_bucketed_outside_the_context() -> None:
    setting = dist.overlap_grad_reduction(bucket_mib=0.0, record=True)
    run("dp", overlap=False, steps=1)
    assert setting.buckets_started == 0 and not setting.events


def _facts(output: str) -> dict[str, str]:
    lines = [line for line in output.splitlines() if not line.startswith("[rank")]
    out = {}
    for line in lines:
        key = line.split(" ", 1)[0]
        out[key] = line
    return out


def _check_run(output: str, sim_digest: str) -> None:
    facts = _facts(output)
    m = re.match(r"digest plain (\w+) overlap (\w+) per-gradient (\w+)", facts["digest"])
    assert m and m.group(1) == m.group(2) == m.group(3) == sim_digest, facts["digest"]
    m = re.match(
        r"all_reduce plain (\d+) x (\d+) B, overlap (\d+) x (\d+) B, per-gradient (\d+) x (\d+) B", facts["all_reduce"]
    )
    assert m, facts["all_reduce"]
    plain_n, plain_b, over_n, over_b, one_n, one_b = map(int, m.groups())
    assert plain_b == over_b == one_b and one_n == plain_n and over_n < plain_n
    m = re.match(r"buckets overlap (\d+) per-gradient (\d+)", facts["buckets"])
    assert m and over_n == plain_n - int(m.group(2)) + int(m.group(1)), facts["buckets"]
    m = re.match(
        r"first start at event (\d+), last backward op at (\d+), buckets started before it (\d+)", facts["first"]
    )
    assert m and int(m.group(1)) < int(m.group(2)) and int(m.group(3)) >= 1, facts["first"]


MPI_RUNS = [(layout, sizes) for sizes in ((), LARGE) for layout in ("dp", "dp_tp")]
"""The training steps run under ``mpiexec``: each layout, with small and large gradients."""


@functools.cache
def _under_mpiexec() -> tuple[Run, list[str]]:
    """``overlap_step.py`` for each of ``MPI_RUNS``, then with ``--cases``, in one ``mpiexec -n 4``
    (``run_examples.py`` runs them in turn): the run, and rank 0's output of each."""
    argv: list[str] = []
    for layout, sizes in MPI_RUNS:
        argv += ["tests/mpi_scripts/overlap_step.py", "--layout", layout, *sizes, "--"]
    argv += ["tests/mpi_scripts/overlap_step.py", "--cases"]
    result = mpirun(4, "tests/mpi_scripts/run_examples.py", *argv, timeout=900)
    return result, re.split(r"^=== .*$", "\n".join(result.lines_of(0)), flags=re.M)[1:]


@pytest.mark.mpi
@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
@pytest.mark.parametrize("sizes", [(), LARGE], ids=["small", "large"])
def test_overlap_under_mpiexec_is_bit_identical_to_the_simulator(layout: str, sizes: tuple[str, ...]) -> None:
    kw = {"hidden": 67, "inner": 1100, "bucket_mib": 1.0} if sizes else {}
    sim = run(layout, overlap=True, **kw)  # type: ignore[arg-type]
    result, outputs = _under_mpiexec()
    assert result.returncode == 0, result.output[-4000:]
    _check_run(outputs[MPI_RUNS.index((layout, sizes))], digest(sim))


@pytest.mark.mpi
def test_started_all_reduces_under_mpiexec_match_blocking_ones() -> None:
    result, outputs = _under_mpiexec()
    assert result.returncode == 0, result.output[-4000:]
    assert outputs[len(MPI_RUNS)].strip().splitlines()[-1] == "ok 110 started all-reduces (_StartedAllReduce)"


@pytest.mark.mpi
def test_overlap_through_the_nccl_standin_is_bit_identical() -> None:
    sim = run("dp_tp", overlap=True, hidden=67, inner=1100, bucket_mib=1.0)
    result = mpirun(
        4,
        "tests/mpi_scripts/nccl_standin_run.py",
        "tests/mpi_scripts/overlap_step.py",
        "--layout",
        "dp_tp",
        *LARGE,
        env=NCCL_ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.output[-4000:]
    assert sum("backend=nccl standin=True" in line for line in result.output.splitlines()) == 4
    _check_run(result.output, digest(sim))
    cases = mpirun(
        4,
        "tests/mpi_scripts/nccl_standin_run.py",
        "tests/mpi_scripts/overlap_step.py",
        "--cases",
        env=NCCL_ENV,
        timeout=300,
    )
    assert cases.returncode == 0, cases.output[-4000:]
    assert "ok 110 started all-reduces (_StreamAllReduce)" in cases.output


@pytest.mark.mpi
@pytest.mark.parametrize(
    "mesh",
    [
        ("--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--recompute", "full"),
        ("--mesh", "dp=4,pp=2", "--recompute", "selective"),
    ],
    ids=["dp2tp2pp2-sp-full", "dp4pp2-sel"],
)
def test_gpt_with_overlap_under_mpiexec_prints_the_simulators_losses(mesh: tuple[str, ...]) -> None:
    """Pipelines and recompute (a nested backward joins the outer pass's buckets) under
    ``--overlap``: the losses of the simulator without overlap, to the last printed digit."""
    common = ("--tiny", "--dtype", "float64", "--steps", "3", "--sample", "0", *mesh)
    sim = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", "8", "examples/gpt.py", *common],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sim.returncode == 0, sim.stderr[-3000:]
    run = mpirun(8, "examples/gpt.py", *common, "--overlap", "0.01", timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    want = [line for line in sim.stdout.splitlines() if line.startswith("step ") and " loss " in line]
    got = [line for line in run.lines_of(0) if line.startswith("step ") and " loss " in line]
    assert len(want) == 3 and got == want, (got, want)
