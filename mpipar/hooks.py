"""Observation hooks: where recorders (plan tracing, memory accounting) plug into execution.

Dispatch calls every ``op_start_hooks`` entry as ``hook.on_op_start(name)`` when an op
begins (before its inputs are resharded) and every ``op_hooks`` entry after it ran (measured
timelines time ops between the two); ``reshard`` calls every ``reshard_hooks`` entry after a
reshard; every backward pass starts by calling the ``backward_hooks``. ``phase`` (forward, backward, optimizer) and ``scope`` (the layer being called)
label what runs inside them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

op_start_hooks: list[Any] = []
op_hooks: list[Any] = []
reshard_hooks: list[Any] = []
backward_hooks: list[Any] = []
"""Called as ``hook.on_backward(roots)`` when an outermost backward pass starts, its tape still whole (plan
tracing records what the tape keeps for backward)."""
stage_runs: list[Any] = []
"""The pipeline stage run in progress (``mpipar.pipeline.runner.StageRun``), innermost last."""

_phase: list[str] = ["forward"]
_scope: list[str] = []
_op_inputs: list[str] = []


def current_phase() -> str:
    return _phase[-1]


def current_scope() -> str:
    return ".".join(s for s in _scope if s)


def resharding_for() -> str | None:
    """The op whose inputs are being resharded right now, if any."""
    return _op_inputs[-1] if _op_inputs else None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    _phase.append(name)
    try:
        yield
    finally:
        _phase.pop()


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    _scope.append(name)
    try:
        yield
    finally:
        _scope.pop()


@contextlib.contextmanager
def op_inputs(op: str) -> Iterator[None]:
    _op_inputs.append(op)
    try:
        yield
    finally:
        _op_inputs.pop()
