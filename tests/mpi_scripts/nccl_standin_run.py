"""Run a script under the NCCL backend with the CuPy/NCCL stand-in (``tests/nccl_standin``), then
report which backend ran and what the stand-in saw, so a test can tell it was not the MPI one.

    MPIPAR_BACKEND=nccl PYTHONPATH=tests/nccl_standin mpiexec -n 4 python tests/mpi_scripts/nccl_standin_run.py examples/paddle_auto/tp.py
"""

from __future__ import annotations

import os
import runpy
import sys

import mpipar as dist

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")

import cupy  # noqa: E402  (the stand-in, loaded by the backend already)

state = cupy.cuda.nccl.state
backend = dist.current_backend()
print(
    f"standin backend={backend.name} standin={getattr(cupy, 'STANDIN', False)} communicators={len(state.created)} "
    f"calls={sum(state.calls.values())} open_groups={state.group_depth}",
    flush=True,
)
