"""Python's garbage collector kept out of the training step (``MPIPAR_GC``).

Ranks of a job wait for each other at every collective, so a pause on one rank stalls all of
them. The cyclic garbage collector pauses a process whenever enough container objects have
been allocated since its last run, and a full (generation 2) collection walks every tracked
object of the process: on an 8-rank GPT step that is over 40,000 objects (the model, the
optimizer's states, imported modules) and about 100 ms, on one rank at a time, at a moment
no rank chooses. Nearly all those objects live for the whole run.

So after the warm-up, at the end of the ``WARMUP_STEPS``-th optimizer step (every rank runs
its optimizer steps in the same order, so all ranks are at the same step boundary), mpipar
collects once and then freezes the surviving objects (``gc.freeze()``): the collector never
walks them again, and later collections walk only what was made after the warm-up. The young
generations' collections (which walk only recent objects) are left as they are.

========  =================================================================================
``MPIPAR_GC``  what happens
========  =================================================================================
unset,    ``freeze``: one collection and ``gc.freeze()`` at the end of the second optimizer
freeze    step of the process (once per process)
off       the collector is left exactly as Python runs it (the opt-out)
========  =================================================================================

The cost of the freeze: cyclic garbage among the frozen objects that becomes unreachable
later (say, a model dropped mid-run) is freed only by ``gc.unfreeze()`` and a collection,
never automatically. Objects freed by reference counting (nearly all tensors and arrays) are
freed as before.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

from mpipar.env import env_choice

ENV = "MPIPAR_GC"
MODES = ("freeze", "off")
WARMUP_STEPS = 2
"""Optimizer steps before the freeze: the first fills the caches (rule decisions, reshard
plans, optimizer states), the second is the first ordinary step."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``MPIPAR_GC``: ``freeze`` (the default) or ``off``."""
    return env_choice(
        ENV,
        MODES,
        "freeze",
        environ,
        explain="freeze: collect once and gc.freeze() after the warm-up steps; off: leave Python's garbage "
        "collector as it is",
    )


class StepCollector:
    """Counts the process's optimizer steps and freezes the heap once, after the warm-up."""

    def __init__(self, warmup_steps: int = WARMUP_STEPS) -> None:
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.frozen = False
        """Whether this process's freeze has happened (it happens once)."""

    def step_done(self, environ: Mapping[str, str] | None = None) -> None:
        """Called at the end of every optimizer step."""
        if self.steps >= self.warmup_steps:
            return  # the common case: one comparison per step after the warm-up
        self.steps += 1
        if self.steps < self.warmup_steps or mode_from_env(environ) == "off":
            return
        gc.collect()
        gc.freeze()
        self.frozen = True


step_collector = StepCollector()


def step_done() -> None:
    """The end of an optimizer step (``mpipar.optimizer.Optimizer.step``)."""
    step_collector.step_done()
