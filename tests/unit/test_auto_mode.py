"""``examples/gpt.py --auto``: the search picks a strategy for the world, prints it and the
runner-up, and the run trains exactly as the same flags given by hand would.

Every run passes ``--profile`` (a copy of the ``cpu-local`` preset) or sets ``HOME`` to a fresh
folder, so no calibration runs and no cache outside the test's folder is touched.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mpi_scripts.launch import mpirun
from processes import environ, run_python

import mpipar as dist
from mpipar.nn import Linear
from simulator.cost import PRESET_DIR

GPT = "examples/gpt.py"
COMMON = ("--tiny", "--dtype", "float64", "--steps", "3", "--sample", "0")
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.M)
CHOICE = re.compile(r"^auto: (chose|runner-up) +(.+?)  \(predicted step ([\d.]+) ms\)$", re.M)


def run(*args: str, home: Path, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=environ(drop_prefix="MPIPAR_", one_thread=True, HOME=str(home)), timeout=timeout)


def losses(text: str) -> list[float]:
    found = LOSS.findall(text)
    assert [int(s) for s, _ in found] == [0, 1, 2], text[-3000:]
    return [float(v) for _, v in found]


def choices(text: str) -> dict[str, tuple[list[str], float]]:
    """``{"chose": (flags, ms), "runner-up": (flags, ms)}`` from the --auto report."""
    return {kind: (shlex.split(flags), float(ms)) for kind, flags, ms in CHOICE.findall(text)}


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cpu-local preset saved as a file of its own (what ``--profile PATH`` reads)."""
    data = json.loads(Path(PRESET_DIR, "cpu-local.json").read_text())
    data["name"] = "cpu-local-copy"
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def simulated(profile: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """``python -m simulator -n 4 gpt.py --auto`` once for the module: its output and its HOME."""
    home = tmp_path_factory.mktemp("home")
    out = run("-m", "simulator", "-n", "4", GPT, *COMMON, "--auto", "--profile", str(profile), home=home)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout, home


def test_auto_in_the_simulator_picks_a_valid_strategy_and_trains_as_its_flags_would(
    simulated: tuple[str, Path],
) -> None:
    text, home = simulated
    assert "auto: profile cpu-local-copy from " in text
    picked = choices(text)
    assert set(picked) == {"chose", "runner-up"}, text
    (flags, ms), (runner_flags, runner_ms) = picked["chose"], picked["runner-up"]
    assert flags != runner_flags and 0 < ms <= runner_ms
    mesh = dict(kv.split("=") for kv in flags[flags.index("--mesh") + 1].split(","))
    assert int(mesh["dp"]) * int(mesh["tp"]) * int(mesh["pp"]) == 4
    assert f"| mesh {flags[flags.index('--mesh') + 1]} (4 ranks) |" in text
    assert not (home / ".cache").exists(), "--profile given: nothing may be calibrated or cached"
    explicit = run("-m", "simulator", "-n", "4", GPT, *COMMON, *flags, home=home)
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    assert losses(text) == losses(explicit.stdout)  # float64, same layout: bit for bit


@pytest.mark.mpi
def test_auto_under_mpiexec_every_rank_trains_rank_0s_choice(simulated: tuple[str, Path], profile: Path) -> None:
    text, home = simulated
    got = mpirun(4, GPT, *COMMON, "--auto", "--profile", str(profile), env={"HOME": str(home)}, timeout=240)
    assert got.returncode == 0, got.output[-4000:]
    assert not re.search(r"^\[rank [1-9]\d*\] (auto:|step \d+ loss)", got.output, re.M), (
        "only rank 0 reports:\n" + got.output
    )
    rank0 = "\n".join(got.lines_of(0))
    assert choices(rank0)["chose"][0] == choices(text)["chose"][0]  # the same profile: the same choice
    # The simulator's --auto run trains what its flags would (test above); mpiexec must print its losses.
    for have, want in zip(losses(rank0), losses(text), strict=True):
        assert abs(have - want) <= 1e-9 * abs(want)


def test_a_plain_run_falls_back_to_the_cpu_preset_and_says_so(tmp_path: Path) -> None:
    out = run(GPT, *COMMON[:3], "--steps", "1", "--sample", "0", "--auto", home=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "using the 'cpu-local' preset" in out.stderr
    assert "auto: profile cpu-local from preset cpu-local (fallback)" in out.stdout
    flags, _ = choices(out.stdout)["chose"]
    assert flags[:2] == ["--mesh", "dp=1,tp=1,pp=1"]
    assert not (tmp_path / ".cache").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--mesh", "dp=2"), "--auto and --mesh dp=2: --auto chooses --mesh itself"),
        (("--schedule", "1F1B"), "--auto and --schedule 1F1B"),
        (("--sequence-parallel",), "--auto and --sequence-parallel:"),
        (("--profile", "no-such-profile"), "--auto: --profile 'no-such-profile': no hardware profile"),
    ],
)
def test_auto_refuses_flags_it_sets_and_unreadable_profiles(
    extra: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    out = run(GPT, "--tiny", "--auto", *extra, home=tmp_path)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


def test_a_malformed_profile_file_is_named_with_its_field(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    data = json.loads(Path(PRESET_DIR, "cpu-local.json").read_text())
    bad.write_text(json.dumps({**data, "name": 3}))
    out = run(GPT, "--tiny", "--auto", "--profile", str(bad), home=tmp_path)
    assert out.returncode != 0 and f"--profile '{bad}'" in out.stderr and "name" in out.stderr, out.stderr[-2000:]


def test_a_memory_limit_only_recompute_meets_picks_it_and_trains_as_its_flags_would(
    profile: Path, tmp_path: Path
) -> None:
    """Two ranks, ``--memory-limit 170000``: only full recompute fits this model (its smallest peaks:
    none 196,096 bytes, selective 186,880, full 152,832; ``tests/unit/test_auto_recompute.py``), so the
    choice and the runner-up both say ``--recompute full``, and training runs with it."""
    out = run(
        "-m",
        "simulator",
        "-n",
        "2",
        GPT,
        *COMMON,
        "--auto",
        "--profile",
        str(profile),
        "--memory-limit",
        "170000",
        home=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "memory limit 170,000 bytes per rank" in out.stdout
    picked = choices(out.stdout)
    for kind in ("chose", "runner-up"):
        flags = picked[kind][0]
        assert flags[flags.index("--recompute") + 1] == "full", out.stdout
    explicit = run("-m", "simulator", "-n", "2", GPT, *COMMON, *picked["chose"][0], home=tmp_path)
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    assert losses(out.stdout) == losses(explicit.stdout)


def test_memory_limit_without_auto_is_an_error(tmp_path: Path) -> None:
    out = run(GPT, "--tiny", "--memory-limit", "1000", home=tmp_path)
    assert out.returncode != 0 and "--memory-limit 1000: only --auto" in out.stderr, out.stderr[-2000:]


def test_profile_without_auto_is_an_error(tmp_path: Path) -> None:
    out = run(GPT, "--tiny", "--profile", "cpu-local", home=tmp_path)
    assert out.returncode != 0 and "--profile cpu-local: only --auto" in out.stderr, out.stderr[-2000:]


# ------------------------------------------------------------------ dist.Strategy(auto=True)
STRATEGY_SCRIPT = "tests/mpi_scripts/auto_strategy.py"


def strategy_run(*args: str, home: Path) -> tuple[list[str], str]:
    """``(loss lines, "chosen <schedule> <m>")`` of the script under ``python -m simulator -n 2``."""
    out = run("-m", "simulator", "-n", "2", STRATEGY_SCRIPT, *args, home=home)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    return [line for line in lines if line.startswith("loss ")], next(
        line for line in lines if line.startswith("chosen ")
    )


def test_strategy_auto_picks_a_schedule_and_trains_as_if_it_was_given(tmp_path: Path) -> None:
    """Two pipeline stages, batch 8: the pick is a real schedule and micro-batch count (ZBH1 or
    1F1B, m dividing 8), reported with its runner-up, and the losses (dropout on) are those of the
    same settings given by hand, bit for bit."""
    out = run("-m", "simulator", "-n", "2", STRATEGY_SCRIPT, "auto", home=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "using the 'cpu-local' preset" in out.stdout and "a training step does not calibrate" in out.stdout
    report = re.search(
        r"^Strategy\(auto=True\): schedule (\S+), (\d+) micro-batches \(predicted step ([\d.]+) ms on cpu-local\); "
        r"runner-up (\S+), (\d+) micro-batches \(([\d.]+) ms\)$",
        out.stdout,
        re.M,
    )
    assert report, out.stdout
    kind, m = report.group(1), int(report.group(2))
    assert kind in ("FThenB", "1F1B", "ZBH1") and 8 % m == 0 and float(report.group(3)) <= float(report.group(6))
    lines = out.stdout.splitlines()
    assert f"chosen {kind} {m}" in lines
    auto_losses = [line for line in lines if line.startswith("loss ")]
    given_losses, given = strategy_run(kind, str(m), home=tmp_path)
    assert given == f"chosen {kind} {m}" and len(auto_losses) == 3 and auto_losses == given_losses


@pytest.mark.mpi
def test_strategy_auto_under_mpiexec_runs_rank_0s_pick_on_every_rank(tmp_path: Path) -> None:
    got = mpirun(2, STRATEGY_SCRIPT, "auto", env={"HOME": str(tmp_path), "MPIPAR_PROFILE": "cpu-local"}, timeout=240)
    assert got.returncode == 0, got.output[-4000:]
    lines = got.lines_of(0)
    chosen = next(line for line in lines if line.startswith("chosen ")).split()
    given_losses, given = strategy_run(chosen[1], chosen[2], home=tmp_path)
    assert given == " ".join(chosen)
    # Rank 1 (the last stage) ran the same schedule, or the step would have deadlocked; the losses
    # are the simulator's run of the same settings (1e-9: MPI's own float64 sums in group order).
    have = [float(line.split()[1]) for line in lines if line.startswith("loss ")]
    want = [float(line.split()[1]) for line in given_losses]
    assert len(have) == 3 and all(abs(h - w) <= 1e-9 * abs(w) for h, w in zip(have, want, strict=True))


def test_strategy_auto_refuses_a_model_it_cannot_price() -> None:
    layer = Linear(4, 4)
    step = dist.to_static(layer, None, lambda out, label: dist.mean(out), None, dist.Strategy(auto=True))
    with pytest.raises(ValueError, match=r"Strategy\(auto=True\) prices mpipar.models.gpt.GPT models, got Linear"):
        step(dist.Tensor(np.ones((2, 4))), dist.Tensor(np.ones((2, 4))))


def test_strategy_auto_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="Strategy auto must be True or False, got 'yes'"):
        dist.Strategy(auto="yes")  # type: ignore[arg-type]
