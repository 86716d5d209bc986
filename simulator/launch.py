"""Run a script under a chosen backend, the way ``python -m simulator`` does."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from mpipar.backend import Backend, set_backend


def run_script(script: str, args: Sequence[str], backend: Backend) -> None:
    """Execute ``script`` as ``__main__`` with ``args`` as its argv, under ``backend``."""
    if not os.path.isfile(script):
        raise SystemExit(f"python -m simulator: no such script: {script}")
    os.environ["MPIPAR_BACKEND"] = backend.name
    set_backend(backend)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
