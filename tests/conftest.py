"""Shared test setup: every test runs under a fresh simulator backend unless it says otherwise."""

from __future__ import annotations

import compileall
import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from plans import trace_plan

import mpipar
from simulator import SimBackend

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "quick",
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


COMPILED = ("mpipar", "simulator", "viz", "examples", "tests/mpi_scripts", "tests/nccl_standin", "tests/scripts")
"""What the tests' subprocesses and MPI ranks import, byte-compiled once per session."""


def pytest_configure(config: pytest.Config) -> None:
    """Write the ``.pyc`` files of ``COMPILED`` once, in the process that starts the run (an
    xdist worker finds them written; up-to-date ones are kept). Under
    ``PYTHONDONTWRITEBYTECODE`` (set in some images) no import writes them, so every subprocess
    and every MPI rank compiled mpipar's modules from source again: about half of its start."""
    if hasattr(config, "workerinput"):
        return
    for folder in COMPILED:
        compileall.compile_dir(os.path.join(REPO, folder), quiet=2)


@pytest.fixture(autouse=True)
def _fresh_sim_backend() -> Iterator[None]:
    """A fresh simulator world (growing with the meshes a test builds) for each test."""
    with mpipar.use_backend(SimBackend()):
        yield


@pytest.fixture(scope="session")
def gpt_plan_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``mpipar plan``'s plan of examples/gpt.py (dp=2,tp=2,pp=2, 1F1B), traced once per session
    for the dashboard tests (read-only: tests load it, never write it)."""
    out = str(tmp_path_factory.mktemp("gpt") / "plan.json")
    return trace_plan(out, 8, "examples/gpt.py", "--mesh", "dp=2,tp=2,pp=2", "--schedule", "1F1B")


QUICK = frozenset(
    f"test_{name}.py"
    for name in (
        "placement",
        "spec",
        "mesh",
        "modes",
        "reshard_plans",
        "reshard_property",
        "reshard_once",
        "spmd_rules",
        "spmd_nearest",
        "split_with_num",
        "ops_equivalence",
        "autograd",
        "training",
        "errors",
        "import_graph",
        "lint",
    )
)
"""The quick loop's files (``pytest tests/unit -m quick --hypothesis-profile=quick``): the core -- placements,
specs, meshes, reshard plans, SPMD rules, ops against the dense result, autograd, a training step,
the error messages -- and the house rules (import layers, lint)."""

TIERS = ("unit", "mpi", "viz", "fuzz")
"""The test folders, each also a marker (``pytest -m unit``): in-process tests of the library and
the simulator; tests that launch ``mpiexec``; the dashboard's renderers, app and browser test;
long generated fuzzing of the file readers."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test carries its folder's tier marker. ``slow`` cases run on demand (``pytest -m slow``
    or ``MPIPAR_SLOW=1``), not in the default suite."""
    for item in items:
        parts = item.path.relative_to(os.path.join(REPO, "tests")).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
        if parts[-1] in QUICK and "mpi" not in item.keywords:
            item.add_marker(pytest.mark.quick)
        if "mpi" in item.keywords:
            # one xdist worker runs every launch of mpiexec, one at a time, as the serial suite
            # did: two jobs of 8 ranks at once on 2 cores would starve each other past their
            # timeouts. The other worker runs the in-process tests beside it.
            item.add_marker(pytest.mark.xdist_group("mpi"))
    if "slow" in (config.getoption("-m") or "") or os.environ.get("MPIPAR_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run on demand with `pytest -m slow` or MPIPAR_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
