"""The three execution modes, decided in one place.

Every piece of code that makes or moves values (op dispatch, tensor creation, the optimizer's
update, ``shard_tensor``/``reshard``) asks ``execution_mode`` how values are held, instead of
testing the backend's flags and the tensors' own marks itself:

* ``ABSTRACT``: shapes and layouts only, no values (the shape-only backend, or any tensor
  involved is abstract). Rules run, reshards are planned, no kernel runs and nothing moves.
* ``DENSE``: one big device (the reference backend). A distributed tensor holds its whole
  value; its placements are labels; nothing is communicated.
* ``DISTRIBUTED``: each distributed tensor holds the shards of the ranks this process hosts;
  reshards move them through the backend's communicator.

A tensor without a layout (dense) is a whole value in every mode but ``ABSTRACT``: an op whose
inputs are all dense runs its kernel on whole values in ``DISTRIBUTED`` mode too.

Below ``tensor.py`` (it asks here whether a lazy value is materialised), so tensors are seen
through the small ``HasMode`` protocol rather than imported.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Protocol

from mpipar.backend import Backend, current_backend


class Mode(enum.Enum):
    ABSTRACT = "abstract"
    DENSE = "dense"
    DISTRIBUTED = "distributed"


class HasMode(Protocol):
    """What the mode needs of a tensor (``mpipar.tensor.Tensor`` provides it)."""

    @property
    def is_abstract(self) -> bool: ...


_static_programs: set[int | None] = set()
"""The programs in Paddle's static-graph mode (``mpipar.enable_static()``): ``static.data``
makes placeholders and the ops on them are recorded into a program
(``mpipar.compile.program``). Kept per program rank (``Backend.program_rank``: one entry,
None, unless the simulator runs one program per rank in threads), and read here, low in the
stack, by the optimizer (``parameters=None`` is legal in static mode)."""


def in_static_mode() -> bool:
    return current_backend().program_rank in _static_programs


def set_static_mode(on: bool) -> None:
    rank = current_backend().program_rank
    if on:
        _static_programs.add(rank)
    else:
        _static_programs.discard(rank)


def execution_mode(tensors: Iterable[HasMode] = (), backend: Backend | None = None) -> Mode:
    """The mode values are held in under ``backend`` (the current one by default), given the
    tensors involved: ``ABSTRACT`` if the backend is shape-only or any of ``tensors`` is
    abstract, else ``DENSE`` under the reference backend, else ``DISTRIBUTED``."""
    backend = current_backend() if backend is None else backend
    if backend.shape_only:
        return Mode.ABSTRACT
    for t in tensors:  # a plain loop: every op asks, and a generator costs more than the answer
        if t.is_abstract:
            return Mode.ABSTRACT
    return Mode.DENSE if backend.reference else Mode.DISTRIBUTED
