"""Launch a script under the venv's ``mpiexec`` (the mpich wheel's hydra) for the MPI tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
SCRIPTS = os.path.join(REPO, "tests", "mpi_scripts")


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float

    def lines_of(self, rank: int) -> list[str]:
        """The lines rank ``rank`` printed, prefix removed (rank 0's carry none)."""
        out = []
        for line in self.output.splitlines():
            m = re.match(r"\[rank (\d+)\] (.*)", line)
            if (m and int(m.group(1)) == rank) or (not m and rank == 0):
                out.append(m.group(2) if m else line)
        return out


def mpirun(n: int, script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> Run:
    """Run ``mpiexec -n n python script args`` from the repo root; stdout and stderr together."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, script, *args],
        cwd=REPO,
        env=full_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, time.monotonic() - start)
