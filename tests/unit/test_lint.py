"""The tree is ruff clean and ruff formatted (the rules and line length in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUFF = os.path.join(os.path.dirname(sys.executable), "ruff")


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    out = subprocess.run([RUFF, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
