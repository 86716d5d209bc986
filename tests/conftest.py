"""Shared test setup: every test runs under a fresh simulator backend unless it says otherwise."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

import mpipar
from simulator import SimBackend

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("ci" if os.environ.get("CI") else "default")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(autouse=True)
def _fresh_sim_backend() -> Iterator[None]:
    """A fresh simulator world (growing with the meshes a test builds) for each test."""
    with mpipar.use_backend(SimBackend()):
        yield
