"""``mpipar plan SCRIPT [args] -o plan.json``: trace a training script's first step into a Plan.

The script runs under the simulator (``-n N`` virtual ranks, or ``--shape-only``: shapes and
layouts, no values) with a plan recorder on. Tracing stops after the first training step --
the first optimizer ``step()`` in eager scripts, the first call of a ``dist.to_static`` model
(whose plan also carries the pipeline stages and schedule) -- and the plan is written; the
script never trains further.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from mpipar.backend import set_backend
from mpipar.compile.plan import HOST_TENSORS_KEY, KEPT_KEY, Plan
from mpipar.compile.to_static import DistModel
from mpipar.compile.trace import PlanRecorder
from mpipar.optimizer.optimizer import Optimizer


class _FirstStepDone(Exception):
    def __init__(self, plan: Plan) -> None:
        super().__init__("first step traced")
        self.plan = plan


def trace_script(script: str, args: Sequence[str], backend: Any, meta: dict[str, Any] | None = None) -> Plan:
    """Run ``script`` until its first training step and return that step's plan."""
    if not os.path.isfile(script):
        raise SystemExit(f"mpipar plan: no such script: {script}")
    set_backend(backend)
    recorder = PlanRecorder({"script": script, "args": list(args), "backend": backend.describe(), **(meta or {})})
    original_step, original_call = Optimizer.step, DistModel.__call__

    def step(self: Optimizer) -> None:
        original_step(self)
        recorder.mark_optimizer(self)  # parameters, gradients, states (offloaded ones named in meta)
        raise _FirstStepDone(recorder.plan())

    def call(self: DistModel, *batch: Any) -> Any:
        Optimizer.step = original_step  # type: ignore[method-assign]
        original_call(self, *batch)
        plan = self.plan
        # This recorder's own notes name its tensor ids, not the model's plan's: only the run's
        # description (script, args, backend) carries over.
        plan.meta.update({k: v for k, v in recorder.meta.items() if k not in (KEPT_KEY, HOST_TENSORS_KEY)})
        raise _FirstStepDone(plan)

    Optimizer.step = step  # type: ignore[method-assign]
    DistModel.__call__ = call  # type: ignore[method-assign]
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with recorder:
            runpy.run_path(script, run_name="__main__")
    except _FirstStepDone as done:
        return done.plan
    finally:
        Optimizer.step = original_step  # type: ignore[method-assign]
        DistModel.__call__ = original_call  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path
    raise SystemExit(f"mpipar plan: {script} finished without a training step (no optimizer step, no to_static call)")
