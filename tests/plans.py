"""Plans traced for the tests: ``mpipar plan`` in a subprocess, one BLAS thread per process."""

from __future__ import annotations

import subprocess
import sys

from processes import REPO, environ


def plan_command(out: str, ranks: int, script: str, *args: str) -> list[str]:
    """``mpipar plan -o out -n ranks script args`` as run from the repository root."""
    return [sys.executable, "-m", "mpipar.cli", "plan", "-o", out, "-n", str(ranks), script, *args]


def trace_plan(out: str, ranks: int, script: str, *args: str) -> str:
    """Write ``script``'s plan to ``out`` (a failure raises with the command's output kept) and return ``out``."""
    subprocess.run(
        plan_command(out, ranks, script, *args),
        cwd=REPO,
        env=environ(one_thread=True),
        check=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )
    return out
