"""Backends: which ranks this process hosts, and the communicator between them.

* ``sim`` (the default without a launcher; registered by the ``simulator`` package): the
  process hosts every rank of every mesh. ``python -m simulator -n N`` fixes the world to N.
* ``reference`` (``python -m simulator --reference``): one big device; no communication.
* ``mpi``: one process per rank over mpi4py (selected when an MPI launcher is detected).
* ``nccl``: like ``mpi`` with CuPy arrays and NCCL collectives (selected when CUDA is usable).

``MPIPAR_BACKEND=sim|mpi|nccl|reference`` overrides the choice. Backends outside mpipar
register through the ``mpipar.backends`` entry-point group, so mpipar never imports them by name.
With ``MPIPAR_TRACE=path`` the first backend installed starts a measured timeline
(``mpipar.debug.measured``).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mpipar import _xp
from mpipar.env import env_text
from mpipar.mesh import ProcessMesh

if TYPE_CHECKING:
    from mpipar.comm import Communicator, ManualTransport


class Backend(ABC):
    """Where ranks live and how they talk."""

    name: str = "abstract"
    reference: bool = False
    """True for the one-big-device oracle: tensors are dense, placements are ignored."""
    shape_only: bool = False
    """True when tensors carry shapes but no data (planning at scale)."""

    @property
    @abstractmethod
    def comm(self) -> Communicator: ...

    @property
    def xp(self) -> Any:
        """The array module local shards live in (NumPy, or CuPy under NCCL)."""
        return np

    @abstractmethod
    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        """The ranks of ``mesh`` this process hosts, in mesh order."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    def world_group(self) -> tuple[int, ...]:
        return tuple(range(self.world_size))

    def hosts(self, rank: int) -> bool:
        return True

    def validate_mesh(self, mesh: ProcessMesh) -> None:
        """Refuse a mesh that names ranks outside the world."""
        ws = self.world_size
        bad = [r for r in mesh.process_ids if r >= ws]
        if bad:
            raise ValueError(
                f"ProcessMesh {mesh.process_ids} names process {bad[0]}, but the world has {ws} "
                f"ranks (0..{ws - 1}) under the {self.name} backend; launch with more ranks "
                f"(python -m simulator -n {max(mesh.process_ids) + 1} ... or mpiexec -n "
                f"{max(mesh.process_ids) + 1} ...) or build a smaller mesh"
            )

    def describe(self) -> str:
        return f"{self.name} (world size {self.world_size})"

    # Per-rank programs in one process (``simulator.per_rank``) override these three; declared
    # here so that callers (tensors, tracing, timelines, dtensor_from_local) ask every backend.
    @property
    def program_rank(self) -> int | None:
        """The rank whose program runs in this thread; None where one program drives every
        hosted rank (this process's programs are not per rank)."""
        return None

    def manual_transport(self, call: str) -> ManualTransport | None:
        """The transport of manual ``call`` for the running per-rank program; None where the
        backend's communicator serves manual mode (MPI, NCCL) or nothing does."""
        return None

    def assemble_locals(self, mesh: ProcessMesh, local: Any) -> dict[int, Any] | None:
        """The pieces of all hosted ranks of ``mesh`` when the running program gave only its
        own piece ``local`` (``dtensor_from_local``); None where one program holds every piece."""
        return None


_factories: dict[str, Callable[..., Backend]] = {}
_current: Backend | None = None
_plugins_loaded = False


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make ``factory`` selectable as ``MPIPAR_BACKEND=name``."""
    _factories[name] = factory


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    # mpipar's own runtime backends.
    register_backend("mpi", _lazy("mpipar.runtime.mpi", "MPIBackend"))
    register_backend("nccl", _lazy("mpipar.runtime.nccl", "NCCLBackend"))
    from importlib.metadata import entry_points

    for ep in entry_points(group="mpipar.backends"):
        hook = ep.load()
        hook()


def _lazy(module: str, cls: str) -> Callable[[], Backend]:
    def make() -> Backend:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            raise RuntimeError(f"backend module {module} is not available: {exc}") from exc
        return getattr(mod, cls)()

    return make


MPI_LAUNCH_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    """True when an MPI launcher (mpiexec/mpirun of MPICH, Open MPI, ...) started this process."""
    return any(v in os.environ for v in MPI_LAUNCH_VARS)


def _auto_name() -> str:
    name = env_text("MPIPAR_BACKEND")
    if name:
        _load_plugins()
        if name.lower() not in _factories:
            raise ValueError(
                f"MPIPAR_BACKEND={name!r} names no backend; registered: {', '.join(sorted(_factories))} "
                "(unset it to choose automatically: sim, or mpi/nccl under mpiexec)"
            )
        return name.lower()
    if launched_by_mpi():
        return "nccl" if _xp.cuda_usable() else "mpi"
    return "sim"


def create_backend(name: str, **options: Any) -> Backend:
    """A new backend by registered name (``options`` go to its factory, e.g. ``world_size``)."""
    _load_plugins()
    if name not in _factories:
        raise ValueError(
            f"unknown mpipar backend {name!r}; registered: {sorted(_factories)} "
            "(is the project installed with `pip install -e .`? the simulator registers through "
            "an entry point)"
        )
    return _factories[name](**options)


def current_backend() -> Backend:
    """The backend of this process, chosen on first use."""
    global _current
    if _current is None:
        _current = create_backend(_auto_name())
        _trace_if_asked(_current)
    return _current


def set_backend(backend: Backend | str) -> Backend:
    """Install ``backend`` (an instance or a registered name) for the rest of the process."""
    global _current
    _current = create_backend(backend) if isinstance(backend, str) else backend
    _trace_if_asked(_current)
    return _current


start_hooks: list[Callable[[Backend], None]] = []
"""Called with each backend installed when ``MPIPAR_TRACE`` is set: ``mpipar.debug.measured``
registers its start here (it builds on this module, so this module does not import it)."""


def _trace_if_asked(backend: Backend) -> None:
    """Start the measured timeline of ``MPIPAR_TRACE`` (once per process; a collective under MPI)."""
    if env_text("MPIPAR_TRACE"):
        for hook in start_hooks:
            hook(backend)


@contextlib.contextmanager
def use_backend(backend: Backend | str) -> Iterator[Backend]:
    """Run a block under another backend (tests compare modes this way)."""
    global _current
    saved = _current
    try:
        yield set_backend(backend)
    finally:
        _current = saved


def get_rank() -> int:
    """This process's rank under MPI; 0 in the simulator."""
    return current_backend().rank


def get_world_size() -> int:
    """The number of processes under MPI; the virtual world's size in the simulator."""
    return current_backend().world_size


# ---------------------------------------------------------------- where meshes meet the backend
_checked_meshes: weakref.WeakKeyDictionary[Backend, set[ProcessMesh]] = weakref.WeakKeyDictionary()
"""Per backend, the meshes already checked against its world: the check runs where meshes meet
the backend (every reshard among them), so each mesh pays for it once, not per call."""


def check_mesh(mesh: ProcessMesh, backend: Backend | None = None) -> None:
    """Refuse a mesh naming ranks outside ``backend``'s world (the current one by default).

    ``ProcessMesh`` is a pure value and checks nothing of the world when built; this is called
    where a mesh first meets a backend (``shard_tensor``, ``reshard``/``reshard_to``,
    ``dtensor_from_local``, ``get_submesh_with_dim``). The simulator without ``-n`` grows its
    world here with the meshes used.
    """
    backend = current_backend() if backend is None else backend
    seen = _checked_meshes.get(backend)
    if seen is None:
        seen = _checked_meshes[backend] = set()
    if mesh not in seen:
        backend.validate_mesh(mesh)
        seen.add(mesh)


def _get_submesh_with_dim(self: ProcessMesh, dim_name: str) -> ProcessMesh:
    """The 1-d mesh along ``dim_name`` through this process (rank 0's under the simulator)."""
    backend = current_backend()
    check_mesh(self, backend)
    hosted = backend.hosted_ranks(self)
    rank = hosted[0] if hosted else self.process_ids[0]
    return ProcessMesh(list(self.rank_group(dim_name, rank)), dim_names=[dim_name])


# Installed from here: the method asks which ranks this process hosts, a question of the
# backend, and mesh.py sits below the backends.
ProcessMesh.get_submesh_with_dim = _get_submesh_with_dim  # type: ignore[attr-defined]
