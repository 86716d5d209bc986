"""Child processes for the tests: ``python`` run from the repository root, its output captured as
text, stdin closed, in an environment the test chooses."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def environ(
    *, drop_prefix: str = "", drop: tuple[str, ...] = (), one_thread: bool = False, **extra: str
) -> dict[str, str]:
    """This process's environment without the variables named in ``drop`` or starting with
    ``drop_prefix`` (when given), with one BLAS thread (``one_thread``) and ``extra`` set."""
    env = {k: v for k, v in os.environ.items() if k not in drop and not (drop_prefix and k.startswith(drop_prefix))}
    return {**env, **(ONE_THREAD if one_thread else {}), **extra}


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``cmd`` from the repository root (``env``: this process's own when None); the caller checks
    the return code."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=env,
    )


def run_python(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python args`` from the repository root; the caller checks the return code."""
    return run([sys.executable, *args], env=env, timeout=timeout)
