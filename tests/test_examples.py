"""Every example: ``--reference`` and ``python -m simulator -n N`` print the same losses.

float64, ``--tiny``, 3 steps, 1e-9 relative (issue 4's acceptance). Also the examples' misuse
errors: wrong world size, mesh degrees whose product is wrong, indivisible batches.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)

CASES = [
    ("seed_dp.py", [], 8),
    ("seed_tp.py", [], 8),
    ("seed_pp.py", [], 8),
    ("seed_hybrid.py", [], 8),
    ("primer_dp.py", [], 8),
    ("primer_mp.py", [], 8),
    ("primer_pp.py", [], 8),
    ("primer_sharding.py", ["--stage", "1"], 8),
    ("primer_sharding.py", ["--stage", "2"], 8),
    ("primer_sharding.py", ["--stage", "3"], 8),
    ("manual_dp.py", [], 8),
    ("manual_sharding.py", [], 8),
    ("manual_mp.py", [], 8),
    ("manual_pp.py", [], 8),
    ("gpt.py", ["--mesh", "dp=8"], 8),
    ("gpt.py", ["--mesh", "tp=8"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=4", "--sequence-parallel"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "1"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "2"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "3"], 8),
    ("gpt.py", ["--mesh", "dp=4,tp=2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2,pp=2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--recompute", "full", "--zero", "2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2", "--recompute", "selective", "--accumulate-steps", "2"], 4),
]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MPIPAR_BACKEND", "MPIPAR_TRACE")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO, env=env
    )


def losses(out: subprocess.CompletedProcess[str]) -> list[float]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [float(v) for _, v in LOSS.findall(out.stdout)]


@pytest.mark.parametrize(("script", "extra", "n"), CASES, ids=[f"{s[:-3]}{''.join(e)}" for s, e, _ in CASES])
def test_reference_and_virtual_ranks_print_the_same_losses(script: str, extra: list[str], n: int) -> None:
    path = os.path.join("examples", script)
    common = ["--tiny", "--dtype", "float64", "--steps", "3", *extra]
    ref = losses(run("-m", "simulator", "--reference", path, *common))
    sim = losses(run("-m", "simulator", "-n", str(n), path, *common))
    assert len(ref) == 3 and len(sim) == 3
    for a, b in zip(ref, sim, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a), (ref, sim)


def test_gpt_degrees_must_multiply_to_the_world() -> None:
    out = run("-m", "simulator", "-n", "8", "examples/gpt.py", "--tiny", "--steps", "1", "--mesh", "dp=2,tp=2")
    assert out.returncode != 0
    assert "dp(2) * tp(2) * pp(1) = 4 != world size 8" in out.stderr


def test_a_world_too_small_for_the_meshes_is_refused() -> None:
    out = run("-m", "simulator", "-n", "4", "examples/seed_hybrid.py", "--tiny", "--steps", "1")
    assert out.returncode != 0
    assert "names process 4, but the world has 4 ranks" in out.stderr or "needs 8 ranks" in out.stderr


def test_gpt_micro_batches_must_divide_the_batch() -> None:
    out = run("examples/gpt.py", "--tiny", "--steps", "1", "--batch-size", "7", "--accumulate-steps", "2")
    assert out.returncode != 0
    assert "--batch-size 7 is not divisible by --accumulate-steps 2" in out.stderr


def test_float32_runs_agree_to_float32_precision() -> None:
    common = ["examples/gpt.py", "--tiny", "--steps", "3", "--mesh", "dp=2,tp=2", "--dtype", "float32"]
    ref = losses(run("-m", "simulator", "--reference", *common))
    sim = losses(run("-m", "simulator", "-n", "4", *common))
    for a, b in zip(ref, sim, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (ref, sim)
