"""Which host each rank runs on: the launcher's host list, its rank-to-host map, mesh locality.

    mpipar launch -n 16 --hosts node1:8,node2:8 train.py      # ranks 0-7 on node1, 8-15 on node2
    mpipar launch -n 16 --hostfile hosts.txt --dry-run train.py

* **Host lists** (``parse_hosts``, ``read_hostfile``) mean what they mean to MPICH's hydra
  (``mpiexec -hosts`` / ``-f``): ``name[:slots]``, one slot when no count is given.
* **Placement** (``place_ranks``): hydra fills the hosts in order, each up to its slots, and
  starts again at the first host when the ranks outnumber the slots. The launcher computes
  the same map, prints it on ``--dry-run`` and hands it to every rank as ``MPIPAR_HOST_MAP``
  (run-length text, ``node1*8,node2*8``): on one machine every alias of it (``127.0.0.1``,
  ``localhost``) gives the same ``MPI.Get_processor_name()``, so the rank cannot find out by
  itself which name the launcher meant.
* **Locality** (``host_mesh``, ``warn_if_spans_hosts``): tensor parallelism exchanges
  activations every layer and belongs inside a host; ``host_mesh`` lays a mesh out so the
  groups along the inner axes (``tp``) are ranks of one host, and the MPI backend warns once
  per mesh when a ``tp`` group spans hosts.
"""

from __future__ import annotations

import math
import os
import re
import socket
import warnings
from collections.abc import Mapping, Sequence

from mpipar.backend import current_backend
from mpipar.env import env_text
from mpipar.mesh import ProcessMesh

HOST_MAP_ENV = "MPIPAR_HOST_MAP"
MAX_HOSTFILE_BYTES = 1 << 20
"""A host file longer than this is refused (a cluster's list is a few KiB)."""
MAX_SLOTS = 1 << 16
_HOST_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]:%]+")
_ENTRY = re.compile(r"(\[[^\]]+\]|[^:\[\]]+)(?::(\d+))?")
TP_AXIS_NAMES = frozenset({"tp", "mp"})
"""Mesh axes whose groups ``warn_if_spans_hosts`` wants inside one host."""


def _entry(text: str, where: str) -> tuple[str, int]:
    """``name`` or ``name:slots`` (IPv6 addresses in brackets: ``[::1]:4``)."""
    m = _ENTRY.fullmatch(text)
    if m is None or not _HOST_NAME.fullmatch(m.group(1)):
        raise ValueError(f"{where}: {text!r} is not a host name (write name or name:slots, e.g. node1:8)")
    count = int(m.group(2) or 1)
    if not 1 <= count <= MAX_SLOTS:
        raise ValueError(f"{where}: host {m.group(1)!r} has {count} slots; give 1 to {MAX_SLOTS}")
    return m.group(1), count


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``--hosts h1:8,h2:8`` as (name, slots) pairs, in order."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"--hosts {text!r}: write a comma-separated list such as node1:8,node2:8")
    return [_entry(t, "--hosts") for t in items]


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """A hydra host file: one ``name[:slots]`` per line; ``#`` starts a comment."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_HOSTFILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise ValueError(f"--hostfile {path}: longer than {MAX_HOSTFILE_BYTES} bytes; is it a host file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--hostfile {path}: not UTF-8 text") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(_entry(line, f"--hostfile {path} line {number}"))
    if not out:
        raise ValueError(f"--hostfile {path}: names no host")
    return out


def place_ranks(hosts: Sequence[tuple[str, int]], nprocs: int) -> list[str]:
    """The host of each rank as hydra places them (hosts in order, each to its slots, wrapping)."""
    if nprocs < 1:
        raise ValueError(f"place_ranks: {nprocs} ranks; need at least 1")
    if not hosts:
        raise ValueError("place_ranks: no hosts")
    out: list[str] = []
    while len(out) < nprocs:
        for name, slots in hosts:
            out.extend([name] * min(slots, nprocs - len(out)))
            if len(out) == nprocs:
                break
    return out


def encode_map(rank_hosts: Sequence[str]) -> str:
    """``a*2,b*2,a`` for [a, a, b, b, a]: runs of equal hosts, in rank order."""
    runs: list[list[object]] = []
    for h in rank_hosts:
        if runs and runs[-1][0] == h:
            runs[-1][1] = int(runs[-1][1]) + 1  # type: ignore[call-overload]
        else:
            runs.append([h, 1])
    return ",".join(f"{h}*{c}" if c != 1 else str(h) for h, c in runs)


def decode_map(text: str, size: int | None = None) -> list[str]:
    """The inverse of ``encode_map``; ``size`` (the world) must match when given."""
    out: list[str] = []
    for item in text.split(","):
        name, _, count = item.strip().rpartition("*") if "*" in item else (item.strip(), "", "1")
        if not name or not _HOST_NAME.fullmatch(name) or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{HOST_MAP_ENV}={text!r}: cannot read {item!r} (write host*count, ...)")
        if len(out) + int(count) > (size if size is not None else 1 << 20):
            raise ValueError(f"{HOST_MAP_ENV}={text!r} names more ranks than the world's {size}")
        out.extend([name] * int(count))
    if size is not None and len(out) != size:
        raise ValueError(f"{HOST_MAP_ENV}={text!r} names {len(out)} ranks, but the world has {size}")
    return out


def format_map(rank_hosts: Sequence[str]) -> list[str]:
    """One line per host: ``node1: ranks 0-7`` (ranges where consecutive)."""
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(rank_hosts):
        by_host.setdefault(h, []).append(r)
    return [f"{h}: rank{'s' if len(rs) > 1 else ''} {ranges(rs)}" for h, rs in by_host.items()]


def ranges(ranks: Sequence[int]) -> str:
    """``0-3,6`` for [0, 1, 2, 3, 6] (ascending ranks)."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ",".join(parts)


def rank_hosts(size: int | None = None, env: Mapping[str, str] | None = None) -> list[str] | None:
    """Every rank's host as the launcher assigned it (``MPIPAR_HOST_MAP``), or None without one.

    ``size`` is the world's (default: the current backend's).

    A map that does not fit the world (another launcher's leftover) is ignored with a warning:
    the hosts are a report, never a reason to stop a run.
    """
    text = env_text(HOST_MAP_ENV, env)
    if not text:
        return None
    size = current_backend().world_size if size is None else size
    try:
        return decode_map(text, size)
    except ValueError as exc:
        warnings.warn(f"{exc}; the ranks' hosts are not reported", RuntimeWarning, stacklevel=2)
        return None


def host_of(rank: int, size: int, env: Mapping[str, str] | None = None) -> str:
    """This rank's host: the launcher's map, else hydra's ``PMI_HOSTNAME``, else the machine's name."""
    env = os.environ if env is None else env
    mapped = rank_hosts(size, env)
    if mapped is not None and 0 <= rank < size:
        return mapped[rank]
    return env.get("PMI_HOSTNAME") or socket.gethostname()


# ------------------------------------------------------------------------------ locality
def host_mesh(
    shape: Sequence[int],
    dim_names: Sequence[str],
    hosts: Sequence[str] | None = None,
    inner: Sequence[str] = ("tp",),
) -> ProcessMesh:
    """``ProcessMesh.by_hosts`` on the launcher's hosts (``rank_hosts()``) unless ``hosts`` are
    given; on one machine (no map) the plain row-major layout."""
    hosts = rank_hosts() if hosts is None else hosts
    if hosts is None:
        hosts = ["localhost"] * math.prod(int(d) for d in shape)
    return ProcessMesh.by_hosts(shape, dim_names, hosts, inner)


def spanning_groups(mesh: ProcessMesh, axis: str, hosts: Sequence[str]) -> list[tuple[tuple[int, ...], list[str]]]:
    """The groups along ``axis`` whose ranks sit on more than one host, with those hosts."""
    out = []
    for group in mesh.groups([axis]):
        names = sorted({hosts[r] for r in group if r < len(hosts)})
        if len(names) > 1:
            out.append((group, names))
    return out


def warn_if_spans_hosts(mesh: ProcessMesh, hosts: Sequence[str] | None) -> bool:
    """Warn (once per call site's mesh) when a group along a ``tp``/``mp`` axis spans hosts."""
    if hosts is None or len(set(hosts)) < 2:
        return False
    warned = False
    for axis in mesh.dim_names:
        if axis not in TP_AXIS_NAMES or mesh.get_dim_size(axis) < 2:
            continue
        spans = spanning_groups(mesh, axis, hosts)
        if spans:
            group, names = spans[0]
            warnings.warn(
                f"ProcessMesh {mesh}: {len(spans)} group(s) along {axis!r} span hosts, e.g. ranks {list(group)} on "
                f"{names}; tensor parallelism exchanges activations every layer and runs far slower across hosts. "
                f"Lay the mesh out with mpipar.host_mesh(shape, dim_names, mpipar.rank_hosts(), inner=({axis!r},)) "
                "or make the axis no larger than the ranks per host",
                RuntimeWarning,
                stacklevel=3,
            )
            warned = True
    return warned
