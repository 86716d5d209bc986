"""Observation hooks: where recorders (plan tracing, memory accounting) plug into execution.

Dispatch calls every ``op_start_hooks`` entry as ``hook.on_op_start(name)`` when an op
begins (before its inputs are resharded) and every ``op_hooks`` entry after it ran (measured
timelines time ops between the two); ``reshard`` calls every ``reshard_hooks`` entry after a
reshard; every backward pass starts by calling the ``backward_hooks``. ``phase`` (forward, backward, optimizer) and ``scope`` (the layer being called)
label what runs inside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from mpipar.mesh import ProcessMesh
    from mpipar.reshard.planner import ReshardPlan
    from mpipar.spec import DistSpec
    from mpipar.tensor import Tensor


# What each registry's entries provide. Protocols, not base classes: the recorders live above
# this module (``trace``, ``debug.measured``, ``overlap``) and need not inherit from it. ``op``
# is an ``ops.dispatch.OpDef`` and ``result`` its ``spmd.SpmdResult`` (None when dense); both
# live above this module, which the ops import.
class OpStartHook(Protocol):
    def on_op_start(self, name: str) -> None: ...


class OpHook(Protocol):
    def on_op(
        self,
        op: Any,
        inputs: Sequence[Tensor],
        used: Sequence[Tensor],
        outputs: Sequence[Tensor],
        result: Any,
        attrs: dict[str, Any],
    ) -> None: ...


class ReshardHook(Protocol):
    def on_reshard(self, src: Tensor, out: Tensor, plan: ReshardPlan, reason: str) -> None: ...

    def on_manual_collective(
        self,
        call: str,
        group: tuple[int, ...],
        kind: str,
        reduce_type: str | None,
        src: str,
        dst: str,
        tensor: Tensor,
        bytes_per_rank: float,
        pieces: tuple[tuple[int, int, int], ...] = (),
    ) -> None: ...


class BackwardHook(Protocol):
    def on_backward(self, roots: Sequence[Tensor]) -> None: ...


class ProgramHook(Protocol):
    """A static program being built (``mpipar.compile.program.Program``): it records the calls
    that make its variables, to run them again on fed values."""

    def on_apply(self, name: str, inputs: Sequence[Any], attrs: dict[str, Any], result: Any) -> None: ...

    def on_shard_tensor(self, tensor: Tensor, mesh: ProcessMesh, placements: Sequence[Any]) -> None: ...

    def on_reshard_call(self, tensor: Tensor, spec: DistSpec, out: Tensor) -> None: ...

    def on_minimize(self, optimizer: Any, loss: Tensor, parameters: Any, no_grad_set: Any) -> bool: ...


class StageRunHook(Protocol):
    """A pipeline stage run in progress (``mpipar.pipeline.runner.StageRun``)."""

    def note_inputs(self, inputs: Sequence[Tensor], mesh: ProcessMesh) -> None: ...

    def op_is_real(self, mesh: ProcessMesh, op: str) -> bool: ...

    def boundary(self, src: Tensor, dst: DistSpec) -> Tensor: ...


op_start_hooks: list[OpStartHook] = []
op_hooks: list[OpHook] = []
reshard_hooks: list[ReshardHook] = []
backward_hooks: list[BackwardHook] = []
"""Called as ``hook.on_backward(roots)`` when an outermost backward pass starts, its tape still whole (plan
tracing records what the tape keeps for backward)."""
program_hooks: list[ProgramHook] = []
"""The static program being built (``mpipar.static``): told of every op call, in-place
``shard_tensor`` and ``reshard`` made outside an op, so it can replay them."""
stage_runs: list[StageRunHook] = []
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


class _Pushed:
    """``with``: ``name`` on ``stack`` inside. A class, not a generator context manager: every
    backward pass, optimizer step and resharded op input opens one."""

    __slots__ = ("name", "stack")

    def __init__(self, stack: list[str], name: str) -> None:
        self.stack = stack
        self.name = name

    def __enter__(self) -> None:
        self.stack.append(self.name)

    def __exit__(self, *exc: object) -> None:
        self.stack.pop()


def phase(name: str) -> _Pushed:
    return _Pushed(_phase, name)


def scope(name: str) -> _Pushed:
    return _Pushed(_scope, name)


def op_inputs(op: str) -> _Pushed:
    return _Pushed(_op_inputs, op)
