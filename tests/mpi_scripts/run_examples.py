"""Runs several example scripts in turn in one process (one ``mpiexec`` launch for many).

``run_examples.py SCRIPT [ARGS...] [-- SCRIPT [ARGS...]]...``: each script runs as ``__main__``
with its own ``sys.argv`` and its folder on ``sys.path`` (as ``python SCRIPT ARGS`` gives it;
``SystemExit(0)`` ends only that script); before each, ``=== SCRIPT`` on every rank (rank 0's
carries no prefix under ``mpiexec``).
"""

from __future__ import annotations

import os
import runpy
import sys

import mpipar


def main(argv: list[str]) -> int:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            runs.append([])
        else:
            runs[-1].append(arg)
    runs = [r for r in runs if r]
    if not runs:
        raise SystemExit("usage: run_examples.py SCRIPT [ARGS...] [-- SCRIPT [ARGS...]]...")
    mpipar.get_rank()  # the backend first: under mpiexec it installs the rank prefix the markers carry
    for script, *args in runs:
        print(f"=== {script}", flush=True)
        folder = os.path.dirname(os.path.abspath(script))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:  # an exit with status 0 ends this script, as it ends `python SCRIPT`
            if exc.code not in (None, 0):
                raise
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
