"""Run a script under a chosen backend, the way ``python -m simulator`` does.

A script written in manual mode (it calls ``dist.all_reduce``, ``dist.send``, ..., or uses
Paddle's ``fleet``, whose layers and optimizer are written in it) runs as one program per
virtual rank (``simulator.per_rank``); any other script runs once, hosting every rank.
``uses_manual_api`` decides, by reading the script's syntax tree.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from collections.abc import Sequence

from mpipar.backend import Backend, set_backend
from simulator.per_rank import ManualModeError, PerRankBackend, run_per_rank

MANUAL_NAMES = frozenset(
    {
        "barrier", "broadcast", "all_reduce", "all_gather", "reduce", "reduce_scatter", "alltoall",
        "scatter", "gather", "send", "recv", "isend", "irecv", "new_group", "mp_allreduce", "c_identity",
    }
)  # fmt: skip


FLEET_NAMES = frozenset({"distributed", "fleet"})
"""``mpipar.distributed`` / ``mpipar.fleet``: Paddle's fleet, per-rank programs like manual mode."""


def uses_manual_api(script: str) -> bool:
    """Does ``script`` call mpipar's manual collectives (``dist.all_reduce(...)`` with ``dist``
    bound to ``mpipar``, ``mpipar.distributed`` or ``mpipar.collective``, or a name imported from
    one), or use fleet or group-sharded parallelism (``import mpipar.distributed.fleet``, ``from
    mpipar.distributed import fleet``, ``paddle.distributed.fleet`` with ``paddle`` bound to
    ``mpipar``)? ``mpipar.distributed``'s auto-parallel names (``ProcessMesh``, ``shard_tensor``,
    ...) alone leave a script semi-automatic: one program hosting every rank."""
    with open(script, encoding="utf-8") as f:
        try:
            tree = ast.parse(f.read(), filename=script)
        except SyntaxError:
            return False  # running it reports the error where it is
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            # ``import mpipar.distributed as dist`` is Paddle's front door for both APIs: manual only
            # where ``dist.fleet`` / ``dist.all_reduce`` / ... are used (checked below), or fleet imported.
            if any(a.name.startswith(("mpipar.distributed.fleet", "mpipar.distributed.sharding")) for a in node.names):
                return True
            aliases |= {
                a.asname or a.name
                for a in node.names
                if a.name in ("mpipar", "mpipar.collective", "mpipar.compat.collective", "mpipar.distributed")
            }
            aliases |= {"mpipar.distributed" for a in node.names if a.name == "mpipar.distributed" and not a.asname}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            ("mpipar.distributed.fleet", "mpipar.distributed.sharding")
        ):
            return True
        elif isinstance(node, ast.ImportFrom) and node.module == "mpipar.distributed":
            if any(a.name in MANUAL_NAMES | FLEET_NAMES | {"sharding"} for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "mpipar",
            "mpipar.collective",
            "mpipar.compat.collective",
        ):
            if any(a.name in MANUAL_NAMES | FLEET_NAMES for a in node.names):
                return True
            aliases |= {a.asname or a.name for a in node.names if a.name == "collective"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in MANUAL_NAMES | FLEET_NAMES:
            base = node.value
            dotted = base.id if isinstance(base, ast.Name) else ast.unparse(base)
            if dotted in aliases or any(dotted == f"{a}.collective" for a in aliases):
                return True
    return False


def _prepare(script: str, args: Sequence[str], backend: Backend) -> None:
    if not os.path.isfile(script):
        raise SystemExit(f"python -m simulator: no such script: {script}")
    os.environ["MPIPAR_BACKEND"] = backend.name
    set_backend(backend)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))


def run_script(script: str, args: Sequence[str], backend: Backend) -> None:
    """Execute ``script`` as ``__main__`` with ``args`` as its argv, under ``backend``."""
    _prepare(script, args, backend)
    runpy.run_path(script, run_name="__main__")


def run_script_per_rank(script: str, args: Sequence[str], world_size: int) -> None:
    """Execute ``script`` once per virtual rank, each in its own thread (``simulator.per_rank``)."""
    backend = PerRankBackend(world_size)
    _prepare(script, args, backend)
    try:
        run_per_rank(lambda: runpy.run_path(script, run_name="__main__"), backend)
    except ManualModeError as exc:
        raise SystemExit(f"python -m simulator: {exc}") from None
