"""The plan the dashboard opens on when no file is given: the project's own GPT, traced shape-only.

``examples/gpt.py`` with its default model and batch (4 layers, hidden 128, 4 heads, sequence
64, batch 16) on a 3-D mesh so every view has something to show: ``dp=2,tp=2,pp=2``, the
``1F1B`` schedule. The trace runs ``mpipar plan --shape-only`` in a child process (it patches
the optimizer and sets the process's backend while it runs, which a dashboard serving other
sessions must not see) and takes a couple of seconds; the app caches the result.

    plan = trace_gpt_plan()          # a Plan, read back through the dashboard's file checks
    GPT_ARGS                         # the example's arguments, shown in the sidebar
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from mpipar.compile.plan import Plan
from viz.files import load_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_SCRIPT = os.path.join(REPO, "examples", "gpt.py")
GPT_ARGS = ("--mesh", "dp=2,tp=2,pp=2", "--schedule", "1F1B")
WORLD_SIZE = 8
TRACE_TIMEOUT_S = 300


class DefaultPlanError(RuntimeError):
    """The GPT plan could not be traced; the message says why (the app falls back to the sample)."""


def gpt_plan_command(output: str) -> list[str]:
    """``python -m mpipar.cli plan -o OUTPUT -n 8 --shape-only examples/gpt.py --mesh ... --schedule 1F1B``."""
    return [
        sys.executable,
        "-m",
        "mpipar.cli",
        "plan",
        "-o",
        output,
        "-n",
        str(WORLD_SIZE),
        "--shape-only",
        GPT_SCRIPT,
        *GPT_ARGS,
    ]


def script_stamp() -> tuple[int, int]:
    """(mtime, size) of ``examples/gpt.py``: the app's cache key, so an edited example is re-traced."""
    try:
        st = os.stat(GPT_SCRIPT)
    except OSError:
        return (0, 0)
    return (st.st_mtime_ns, st.st_size)


def trace_gpt_plan() -> Plan:
    """Trace the GPT plan in a child process and read it back (``viz.files.load_path``'s checks)."""
    if not os.path.isfile(GPT_SCRIPT):
        raise DefaultPlanError(f"{GPT_SCRIPT} is missing: the GPT plan cannot be traced")
    env = {
        **os.environ,
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p),
    }
    env.pop("MPIPAR_TRACE", None)  # the trace is not a run: no measured timeline from it
    with tempfile.TemporaryDirectory(prefix="mpipar-viz-") as tmp:
        out = os.path.join(tmp, "gpt-plan.json")
        try:
            done = subprocess.run(
                gpt_plan_command(out),
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=TRACE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DefaultPlanError(f"tracing {GPT_SCRIPT} took over {TRACE_TIMEOUT_S} s") from None
        if done.returncode != 0 or not os.path.isfile(out):
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
            raise DefaultPlanError(f"tracing {GPT_SCRIPT} failed (exit {done.returncode}): " + " | ".join(tail))
        plan = load_path(out)
    if not isinstance(plan, Plan):
        raise DefaultPlanError(f"tracing {GPT_SCRIPT} wrote a timeline, not a plan")
    return plan
