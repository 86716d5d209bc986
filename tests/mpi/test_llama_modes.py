"""The Llama and context parallelism in the three launch modes: one launch each.

``tests/mpi_scripts/llama_meshes.py`` trains the tiny Llama (and the GPT under cp) two steps on
data, tensor (key/value heads split and replicated), sequence, pipeline and context-parallel
meshes, fused and plain attention, float64, after loading a Hugging Face safetensors
checkpoint into each; run by ``python -m simulator -n 8``, ``--reference`` and ``mpiexec -n 8``,
every mesh must print the single device's losses, and mpiexec the simulator's bit for bit.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from mpi_scripts.launch import mpirun
from processes import environ, run_python


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=environ(drop=("MPIPAR_BACKEND",), one_thread=True))


LOSS = re.compile(r"(\S+) step (\d+) loss (\S+)")


def _mesh_losses(text: str) -> dict[tuple[str, int], float]:
    return {(m.group(1), int(m.group(2))): float(m.group(3)) for m in map(LOSS.fullmatch, text.splitlines()) if m}


def _check_against_single(losses: dict[tuple[str, int], float], where: str) -> None:
    cases = {case for case, _ in losses}
    assert len(cases) >= 10, (where, cases)
    for (case, step), value in losses.items():
        base = "gpt-single" if case.startswith("gpt") else "single"
        assert value == pytest.approx(losses[(base, step)], rel=1e-12), (where, case, step)


def test_llama_and_cp_losses_equal_one_device_in_every_launch_mode(tmp_path: Path) -> None:
    script = "tests/mpi_scripts/llama_meshes.py"
    sim = _cli("-m", "simulator", "-n", "8", script, str(tmp_path))
    assert sim.returncode == 0, sim.stderr[-3000:]
    ref = _cli("-m", "simulator", "--reference", script, str(tmp_path))
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = mpirun(8, script, str(tmp_path), timeout=300)
    assert run.returncode == 0, run.output[-4000:]
    modes = {"simulator": _mesh_losses(sim.stdout), "reference": _mesh_losses(ref.stdout)}
    modes["mpiexec"] = _mesh_losses("\n".join(run.lines_of(0)))
    for where, losses in modes.items():
        _check_against_single(losses, where)
    assert modes["mpiexec"] == modes["simulator"]  # every backend reduces in group order: bit for bit
    assert modes["reference"].keys() == modes["simulator"].keys()
