"""Every training example under ``mpiexec -n 2/4/8`` prints the simulator's losses.

For each case the example runs twice, unchanged: ``python -m simulator -n N script ...`` and
under ``mpiexec -n N`` (the mpich wheel's launcher, no flags, no environment set by hand), both
at ``--tiny --dtype float64 --steps 3``. The cases of one world size share one launch:
``tests/mpi_scripts/run_examples.py`` runs their scripts in turn as ``__main__``, each with its
own arguments, and marks where each begins, so each case is checked on its own lines (a fresh
``mpiexec -n N python script`` per example is what the NCCL, overlap and trace tests launch). The losses rank 0 prints must agree
to 1e-9 relative (the README's promise for float64); in practice they are bit-identical,
because every backend reduces in group order. Only rank 0 may print training lines. A few
cases run again with ``MPIPAR_REDUCE=native`` (MPI's own float sums), where only the 1e-9
promise holds.

    .venv/bin/python -m pytest -q tests/mpi/test_mpi_examples.py      # about a minute on 2 cores
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import pytest
from mpi_scripts.launch import REPO, Run, mpirun

pytestmark = pytest.mark.mpi

COMMON = ("--tiny", "--dtype", "float64", "--steps", "3")
STEPS = 3
RTOL = 1e-9
LOSS_LINE = re.compile(r"step (\d+) loss (\S+)(.*)")
"""A training line: the step, the loss, and further metrics (primer's accuracies), compared exactly."""

# (script, world size, extra flags). Every example runs at 8 ranks (extra ranks idle where
# its meshes are smaller) and at the size its meshes need.
CASES: list[tuple[str, int, tuple[str, ...]]] = [
    ("paddle_auto/dp.py", 4, ()),
    ("paddle_auto/dp.py", 8, ()),
    ("paddle_auto/tp.py", 4, ()),
    ("paddle_auto/tp.py", 8, ()),
    ("paddle_auto/pp.py", 8, ()),
    ("paddle_auto/hybrid.py", 8, ()),
    ("paddle_auto/primer_dp.py", 2, ()),
    ("paddle_auto/primer_dp.py", 8, ()),
    ("paddle_auto/primer_mp.py", 2, ()),
    ("paddle_auto/primer_mp.py", 8, ()),
    ("paddle_auto/primer_pp.py", 2, ()),
    ("paddle_auto/primer_pp.py", 8, ()),
    *[("paddle_auto/primer_sharding.py", n, ("--stage", str(stage))) for stage in (1, 2, 3) for n in (2, 8)],
    ("oneflow/data.py", 2, ()),
    ("oneflow/model.py", 2, ()),
    ("oneflow/pipeline.py", 2, ()),
    ("oneflow/hybrid.py", 8, ()),
    ("gpt.py", 8, ("--mesh", "dp=8")),
    ("gpt.py", 2, ("--mesh", "tp=2")),
    ("gpt.py", 4, ("--mesh", "dp=2,tp=2", "--sequence-parallel")),
    *[("gpt.py", 4, ("--mesh", "dp=4", "--zero", str(stage))) for stage in (1, 2, 3)],
    ("gpt.py", 8, ("--mesh", "dp=2,tp=2,pp=2")),
    ("gpt.py", 8, ("--mesh", "dp=2,tp=4", "--recompute", "selective")),
    ("gpt.py", 8, ("--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--recompute", "full")),
    ("gpt.py", 8, ("--mesh", "dp=4,pp=2", "--zero", "3", "--recompute", "selective")),
    ("gpt.py", 4, ("--mesh", "dp=2,tp=2", "--zero", "2", "--accumulate-steps", "2")),
    ("gpt.py", 4, ("--mesh", "cp=2,tp=2", "--attention", "fused")),
    ("llama.py", 8, ("--mesh", "dp=2,cp=2,tp=2", "--sequence-parallel")),
]


def _case_id(case: tuple[str, int, tuple[str, ...]]) -> str:
    script, n, extra = case
    return f"{script.removesuffix('.py')}-n{n}" + "".join(f"-{a.lstrip('-')}" for a in extra)


def _losses(lines: list[str], where: str) -> list[tuple[int, str, str]]:
    """(step, printed loss, the rest of the line) of every training line; exactly steps 0..STEPS-1."""
    found = [(int(m.group(1)), m.group(2), m.group(3)) for line in lines if (m := LOSS_LINE.fullmatch(line.strip()))]
    assert [s for s, _, _ in found] == list(range(STEPS)), (
        f"{where}: expected steps 0..{STEPS - 1}, got lines:\n" + "\n".join(lines)
    )
    return found


def _simulate(script: str, n: int, args: tuple[str, ...]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", str(n), script, *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"simulator failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout.splitlines()


@pytest.mark.parametrize(("script", "n", "extra"), CASES, ids=[_case_id(c) for c in CASES])
def test_example_under_mpiexec_prints_the_simulators_losses(
    script: str, n: int, extra: tuple[str, ...], record_property: pytest.RecordProperty
) -> None:
    record_property("printed_losses_identical", _compare_with_simulator(script, n, extra))


# MPIPAR_REDUCE=native: float sums by MPI's own algorithms. Data parallel (gradient
# all-reduce), ZeRO (reduce-scatter) and tp x pp (activation all-reduces, stage transfers).
NATIVE_CASES: list[tuple[str, int, tuple[str, ...]]] = [
    ("gpt.py", 8, ("--mesh", "dp=2,tp=2,pp=2")),
    ("paddle_auto/primer_sharding.py", 8, ("--stage", "2")),
    ("paddle_auto/dp.py", 4, ()),
]


@pytest.mark.parametrize(("script", "n", "extra"), NATIVE_CASES, ids=[_case_id(c) for c in NATIVE_CASES])
def test_native_sums_keep_the_losses_within_the_promise(script: str, n: int, extra: tuple[str, ...]) -> None:
    _compare_with_simulator(script, n, extra, native=True)


Case = tuple[str, int, tuple[str, ...]]


@functools.cache
def _launch(cases: tuple[Case, ...], native: bool) -> tuple[Run, list[list[list[str]]]]:
    """One ``mpiexec`` running ``cases`` (all of one world size) in turn; with the run, each
    case's lines per rank (what rank r printed after the case's ``=== SCRIPT`` marker)."""
    n = cases[0][1]
    argv: list[str] = []
    for script, _, extra in cases:
        argv += [*(["--"] if argv else []), f"examples/{script}", *extra, *COMMON]
    env = {"MPIPAR_REDUCE": "native"} if native else None
    run = mpirun(n, "tests/mpi_scripts/run_examples.py", *argv, env=env, timeout=180 * len(cases))
    sections: list[list[list[str]]] = [[[] for _ in range(n)] for _ in cases]
    for rank in range(n):
        k = -1
        for line in run.lines_of(rank):
            if line.startswith("=== examples/"):
                k += 1
                assert k < len(cases) and line == f"=== examples/{cases[k][0]}", (rank, line)
            elif k >= 0:
                sections[k][rank].append(line)
    return run, sections


def _compare_with_simulator(script: str, n: int, extra: tuple[str, ...], native: bool = False) -> bool:
    """Run both ways, assert losses within RTOL and metrics equal; True when printed identically."""
    path = f"examples/{script}"
    args = (*extra, *COMMON)
    expected = _losses(_simulate(path, n, args), f"python -m simulator -n {n} {path}")

    group = tuple(c for c in (NATIVE_CASES if native else CASES) if c[1] == n)
    run, sections = _launch(group, native)
    assert run.returncode == 0, run.output[-4000:]
    lines = sections[group.index((script, n, extra))]
    others = [f"[rank {r}] {line}" for r in range(1, n) for line in lines[r] if re.match(r"step \d+ loss", line)]
    assert not others, "training lines must come from one rank only:\n" + "\n".join(others)
    got = _losses(lines[0], f"mpiexec -n {n} {path}")

    for (step, want, want_rest), (_, have, have_rest) in zip(expected, got, strict=True):
        w, h = float(want), float(have)
        assert abs(h - w) <= RTOL * abs(w), (
            f"step {step}: mpiexec loss {have} vs simulator {want} (relative {abs(h - w) / abs(w):.3g})"
        )
        assert have_rest == want_rest, f"step {step}: mpiexec metrics {have_rest!r} vs simulator {want_rest!r}"
    return got == expected


def test_gpt_first_run_under_mpiexec_is_data_parallel_and_rank_0_explains_it() -> None:
    """No --mesh under ``mpiexec -n 4``: dp=4, one header, the simulator's losses and sample, rank 0 only."""
    args = ("--tiny", "--dtype", "float64", "--steps", "3", "--sample", "10")
    sim = [line for line in _simulate("examples/gpt.py", 4, args) if not re.match(r"(trained|step \d+:) ", line)]
    run = mpirun(4, "examples/gpt.py", *args, timeout=180)
    assert run.returncode == 0, run.output[-4000:]
    assert not re.search(r"^\[rank [1-9]\d*\]", run.output, re.M), "only rank 0 prints:\n" + run.output
    lines = run.lines_of(0)
    assert sum(line.startswith("GPT: ") for line in lines) == 1 and "| mesh dp=4 (4 ranks) |" in lines[0]
    assert [line for line in lines if re.match(r"step \d+: [\d.]+ ms/step, [\d,]+ tokens/s$", line)] != []
    assert re.search(r"^trained 3 steps in ", run.output, re.M)
    # Header, loss lines and sample: the same text as the simulator's run (timings aside).
    assert [line for line in lines if not re.match(r"(trained|step \d+:) ", line)] == sim
