"""The simulator's backends: virtual ranks in one process, and the one-big-device reference.

Registered with mpipar through the ``mpipar.backends`` entry point (see ``pyproject.toml``),
so ``mpipar`` never imports this package by name.
"""

from __future__ import annotations

from mpipar.backend import Backend, register_backend
from mpipar.comm import Communicator, NoCommunicator
from mpipar.mesh import ProcessMesh
from simulator.allocator import keep_freed_memory
from simulator.virtual_comm import VirtualCommunicator


class SimBackend(Backend):
    """Hosts every rank of every mesh. ``world_size=None`` grows the world with the meshes built.

    ``reuse_freed_memory`` (on by default; glibc only): every rank's buffers live in this
    process, so each step allocates and frees many weight-sized arrays; glibc's malloc is told,
    process-wide, to keep freed memory for the next step instead of mapping fresh pages
    (``simulator.allocator``). It changes where memory comes from, never a value.
    """

    name = "sim"

    def __init__(self, world_size: int | None = None, reuse_freed_memory: bool = True) -> None:
        if world_size is not None and world_size < 1:
            raise ValueError(f"the simulator needs at least one rank, got -n {world_size}")
        if not isinstance(reuse_freed_memory, bool):
            raise TypeError(f"SimBackend: reuse_freed_memory must be True or False, got {reuse_freed_memory!r}")
        if reuse_freed_memory:
            keep_freed_memory()
        self._fixed = world_size
        self._seen = 0
        self._comm: Communicator = VirtualCommunicator()

    @property
    def comm(self) -> Communicator:
        return self._comm

    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        return tuple(mesh.process_ids)

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._fixed if self._fixed is not None else max(self._seen, 1)

    def validate_mesh(self, mesh: ProcessMesh) -> None:
        if self._fixed is not None:
            super().validate_mesh(mesh)
        self._seen = max(self._seen, max(mesh.process_ids) + 1)

    def describe(self) -> str:
        size = self._fixed if self._fixed is not None else "grows with the meshes"
        return f"simulator, every rank in this process (world size {size})"


class ReferenceBackend(SimBackend):
    """One big device: tensors are dense, placements are kept as labels only, nothing moves."""

    name = "reference"
    reference = True

    def __init__(self, world_size: int | None = None) -> None:
        super().__init__(world_size, reuse_freed_memory=False)  # one device's arrays, or none
        self._comm = NoCommunicator()

    def describe(self) -> str:
        return "reference: one big device, no communication"


class ShapeOnlyBackend(SimBackend):
    """Plans without data: tensors carry shapes and layouts, no kernel runs, reshards are planned.

    Meshes are not limited by this machine: a 1024-rank plan costs what its rules and
    reshard plans cost, not what its tensors would.
    """

    name = "shape-only"
    shape_only = True

    def __init__(self, world_size: int | None = None) -> None:
        super().__init__(world_size, reuse_freed_memory=False)  # one device's arrays, or none
        self._comm = NoCommunicator()

    def describe(self) -> str:
        return "shape-only: layouts and shapes, no values"


def register() -> None:
    register_backend("sim", SimBackend)
    register_backend("reference", ReferenceBackend)
    register_backend("shape-only", ShapeOnlyBackend)
