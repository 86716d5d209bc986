"""Where a captured step's tracer plugs in (``mpipar.compile.capture``, ``compile_step(capture=True)``).

The places that run a step's local array work (dispatch's kernels, distribute's reshards, the
autograd engine, creation, the optimizer, a tensor read in Python) live below ``mpipar.compile.capture``
and report to the active tracer through this module, which imports nothing of ours: ``tensor``
itself reports here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol


class CaptureTracer(Protocol):
    """A compiled step being traced into a program of local array work (``mpipar.compile.capture.Tracer``,
    above the ops and the optimizer): the places that run such work report each call to it."""

    thread: int
    """The thread tracing (work on another thread is not part of the program)."""

    def refuse(self, reason: str) -> None: ...

    def escape(self, what: str) -> None: ...

    def note_leaf(self, leaf: Any) -> None: ...

    def note_optimizer(self, opt: Any) -> None: ...

    def record_kernel(
        self,
        op: Any,
        ctx: Any,
        attrs: dict[str, Any],
        dtypes: Sequence[Any],
        used: Sequence[Any],
        r: int | None,
        arrays: Sequence[Any],
        got: Any,
        dense: bool = False,
        raw: Any = None,
    ) -> None: ...

    def reshard(self, plan: Any, tensor: Any, backend: Any) -> dict[int, Any]: ...

    def from_global(self, dst: Any, tensor: Any) -> dict[int, Any]: ...

    def shard_array(self, spec: Any, data: Any, dtype: Any) -> dict[int, Any]: ...

    def create(self, make: Any, shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[Any, ...]: ...

    def update(
        self, opt: Any, p: Any, lr: float, src: Any, gv: Any, state: dict[str, Any], r: int, cdt: Any
    ) -> tuple[Any, dict[str, Any]]: ...

    def bump_step(self, opt: Any, p: Any) -> None: ...


capture_tracers: list[CaptureTracer] = []
"""The tracer recording now (at most one: a compiled step called inside a traced one runs eagerly
and its work is recorded by the outer trace). Call sites test this list before anything else."""


def capture_tracer() -> CaptureTracer | None:
    """The active tracer of this thread, if any (work on another thread makes it refuse)."""
    if not capture_tracers:
        return None
    tr = capture_tracers[-1]
    if tr.thread != threading.get_ident():
        tr.refuse("the step runs work on another thread (per-rank programs)")
        return None
    return tr
