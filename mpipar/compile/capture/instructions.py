"""The records a captured program is made of: instructions over numbered slots and their kinds."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

Array = Any
"""A local array: NumPy's, or a device array (CuPy) under the NCCL backend."""


class Refused(Exception):
    """Raised inside the tracer to abandon a capture (never reaches the user)."""


class Stale(Exception):
    """A captured program's check failed on this call: run it eagerly and trace again."""


class Kind(enum.IntEnum):
    """What a recorded call gives back, so how its output slots are filled."""

    ONE = 0
    """One array, into one slot."""
    SEVERAL = 1
    """A tuple of arrays, one per output slot."""
    EFFECT = 2
    """Nothing: a Python effect replayed on every run (an optimizer's step count)."""


class Instruction(NamedTuple):
    """One recorded call: ``fn`` of the arrays in ``inputs`` (slots), results into ``outputs``
    (a slot for ``Kind.ONE``, a tuple of slots for ``Kind.SEVERAL``, None for an effect)."""

    fn: Callable[..., Any]
    inputs: tuple[int, ...]
    outputs: Any
    kind: Kind

    def made(self) -> tuple[int, ...]:
        """The slots this instruction writes."""
        if self.kind is Kind.EFFECT:
            return ()
        return (self.outputs,) if self.kind is Kind.ONE else tuple(self.outputs)


class RunKind(enum.IntEnum):
    """How ``Program.run`` calls an instruction: the trace's kinds, with the commonest shapes of
    a one-output call split out so that no argument list is built for them."""

    ONE = 0
    SEVERAL = 1
    UNARY = 3
    """One output of one input."""
    BINARY = 4
    """One output of two inputs (most kernels)."""
    EFFECT = 5


class Step(NamedTuple):
    """An instruction as the program runs it, with the slots it reads or makes for the last time
    (``drop``: the run lets them go right after it)."""

    fn: Callable[..., Any]
    inputs: tuple[int, ...]
    outputs: Any
    kind: RunKind
    drop: tuple[int, ...]


Indexed = list[tuple[int, Instruction]]
"""Instructions with their index in the trace (``Tracer.pure``, ``.updates`` and ``.bumps`` name them by it)."""


class Planned(Protocol):
    """What a trace's validation run needs of a program: its instructions as it runs them
    (folded, reordered), the slots it never makes (read from another), its constants."""

    instrs: list[Instruction]
    alias: dict[int, int]
    template: list[Any]
