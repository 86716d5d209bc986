"""The launcher's command lines: ``mpipar launch`` and Paddle's ``python -m mpipar.distributed.launch``.

    mpipar launch -n 4 [--simulate] [--hosts h1:2,h2:2 | --hostfile F] [--log-dir logs]
                  [--max-restarts K] [--hang-timeout S] [--dry-run] [--] train.py args...
    python -m mpipar.distributed.launch --gpus=0,1 --log_dir logs train.py args...

Both parse into one ``LaunchOptions``. Paddle's flags map as follows: ``--devices``/``--gpus``/
``--device``/``--selected_gpus`` (a device list: one rank per device, ``CUDA_VISIBLE_DEVICES``
set to the list), ``--nproc_per_node`` (ranks per host), ``--ips`` (hosts, each with
``nproc_per_node`` slots), ``--log_dir`` (default ``log``, as Paddle's), ``--max_restart``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpipar import cliargs
from mpipar.runtime.hosts import parse_hosts, place_ranks, read_hostfile

DEFAULT_HANG_TIMEOUT_S = 300.0
MAX_RESTARTS = 1000


@dataclass
class LaunchOptions:
    nprocs: int
    script: str
    args: list[str]
    simulate: bool = False
    hosts: list[tuple[str, int]] | None = None
    host_source: str | None = None
    """``--hosts TEXT`` or ``--hostfile PATH``: handed to mpiexec as given (``-hosts`` / ``-f``)."""
    log_dir: str = "logs"
    max_restarts: int = 0
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S
    checkpoint_dir: str | None = None
    dry_run: bool = False
    mpi_launcher: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    """Extra variables for every rank (Paddle's device list)."""

    def rank_hosts(self) -> list[str] | None:
        """Each rank's host as mpiexec will place it, or None on one machine without a host list."""
        return place_ranks(self.hosts, self.nprocs) if self.hosts else None


def _add_common(p: argparse.ArgumentParser, *, paddle: bool) -> None:
    """The flags both spellings share (Paddle's with underscores; its own names for two of them)."""
    dash = "_" if paddle else "-"
    p.add_argument("--simulate", action="store_true", help="virtual ranks in one process (python -m simulator -n N)")
    p.add_argument(
        f"--log{dash}dir",
        dest="log_dir",
        default="log" if paddle else "logs",
        help=f"where each attempt's folder of workerlog.<rank> goes (default: {'log' if paddle else 'logs'})",
    )
    p.add_argument(
        "--max_restart" if paddle else "--max-restarts",
        dest="max_restarts",
        type=cliargs.int_range(0, MAX_RESTARTS, "a restart count"),
        default=0,
        metavar="K",
        help="relaunch a failed attempt up to K times, resuming from the latest complete checkpoint",
    )
    p.add_argument(
        f"--hang{dash}timeout",
        dest="hang_timeout",
        type=cliargs.finite_float(0.5, 86400.0, "seconds"),
        default=DEFAULT_HANG_TIMEOUT_S,
        metavar="S",
        help="a rank whose steps and communication stand still this long outside a wait for its peers is hung: "
        f"it is named with its Python stack and the attempt ends (default {DEFAULT_HANG_TIMEOUT_S:g})",
    )
    p.add_argument(
        f"--checkpoint{dash}dir",
        dest="checkpoint_dir",
        default=None,
        metavar="D",
        help="where the script saves step-<k> checkpoints (default: the script's own --save-dir); a restart resumes "
        "from D's latest complete one",
    )
    p.add_argument(f"--dry{dash}run", dest="dry_run", action="store_true", help="print the command and rank map only")
    p.add_argument(
        f"--mpi{dash}launcher",
        dest="mpi_launcher",
        default=None,
        metavar="NAME",
        help="hydra's launcher (ssh, rsh, fork, slurm, ...); default: fork when every host is this machine, "
        "else hydra's own choice",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(
        prog="mpipar launch",
        description="Start a training script on N ranks (mpiexec, or the simulator), with per-rank logs, "
        "heartbeats and automatic restarts from the latest checkpoint.",
    )
    p.add_argument("-n", "--nprocs", type=cliargs.int_range(1, cliargs.MAX_WORLD, "a world size"), required=True)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", default=None, metavar="H1:N,H2:N", help="hosts and their slots, as mpiexec -hosts")
    where.add_argument("--hostfile", default=None, metavar="F", help="a host file, as mpiexec -f")
    _add_common(p, paddle=False)
    return p


def parse(argv: Sequence[str]) -> LaunchOptions:
    p = parser()
    ns = p.parse_args(list(argv))
    if ns.simulate and (ns.hosts or ns.hostfile):
        p.error("--simulate runs every rank in this process: --hosts/--hostfile do not apply")
    try:
        hosts = parse_hosts(ns.hosts) if ns.hosts else read_hostfile(ns.hostfile) if ns.hostfile else None
    except ValueError as exc:
        p.error(str(exc))
    source = f"-hosts {ns.hosts}" if ns.hosts else f"-f {ns.hostfile}" if ns.hostfile else None
    return _options(ns, hosts, source)


def _options(ns: argparse.Namespace, hosts: list[tuple[str, int]] | None, source: str | None) -> LaunchOptions:
    return LaunchOptions(
        nprocs=ns.nprocs,
        script=ns.script,
        args=list(ns.args),
        simulate=ns.simulate,
        hosts=hosts,
        host_source=source,
        log_dir=ns.log_dir,
        max_restarts=ns.max_restarts,
        hang_timeout=ns.hang_timeout,
        checkpoint_dir=ns.checkpoint_dir,
        dry_run=ns.dry_run,
        mpi_launcher=ns.mpi_launcher,
    )


# ------------------------------------------------------------------------------ Paddle's spelling
def paddle_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(
        prog="python -m mpipar.distributed.launch",
        description="Paddle's launcher flags on mpipar's launcher (mpipar launch): one rank per device.",
    )
    p.add_argument(
        "--devices",
        "--gpus",
        "--device",
        "--selected_gpus",
        dest="devices",
        default=None,
        metavar="0,1,...",
        help="one rank per listed device (CUDA_VISIBLE_DEVICES is set to the list)",
    )
    p.add_argument(
        "--nproc_per_node",
        type=cliargs.int_range(1, cliargs.MAX_WORLD, "a rank count"),
        default=None,
        help="ranks per host (default: one per device, or 1)",
    )
    p.add_argument("--ips", default=None, metavar="IP1,IP2", help="hosts; each runs nproc_per_node ranks")
    _add_common(p, paddle=True)
    return p


def parse_paddle(argv: Sequence[str]) -> LaunchOptions:
    p = paddle_parser()
    ns = p.parse_args(list(argv))
    devices: list[str] = []
    if ns.devices is not None:
        devices = [d.strip() for d in ns.devices.split(",")]
        if not all(d.isdigit() for d in devices) or len(set(devices)) != len(devices):
            p.error(f"--devices {ns.devices!r}: write distinct device numbers, e.g. 0,1,2,3")
    per_node = ns.nproc_per_node or len(devices) or 1
    if devices and ns.nproc_per_node is not None and ns.nproc_per_node != len(devices):
        p.error(f"--nproc_per_node {ns.nproc_per_node} and --devices {ns.devices} ({len(devices)} devices) disagree")
    hosts = None
    if ns.ips is not None:
        if ns.simulate:
            p.error("--simulate runs every rank in this process: --ips does not apply")
        try:
            hosts = [(name, per_node) for name, _ in parse_hosts(ns.ips)]
        except ValueError as exc:
            p.error(str(exc).replace("--hosts", "--ips"))
    ns.nprocs = per_node * (len(hosts) if hosts else 1)
    if not math.isfinite(ns.nprocs) or ns.nprocs > cliargs.MAX_WORLD:
        p.error(f"{ns.nprocs} ranks is over the limit of {cliargs.MAX_WORLD}")
    source = "-hosts " + ",".join(f"{h}:{n}" for h, n in hosts) if hosts else None
    out = _options(ns, hosts, source)
    if devices:
        out.env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return out


def script_save_dir(args: Sequence[str]) -> str | None:
    """The script's own ``--save-dir D`` (``--save-dir=D``), where gpt.py and llama.py put checkpoints."""
    for i, a in enumerate(args):
        if a == "--save-dir" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--save-dir="):
            return a.split("=", 1)[1]
    return None


def checkpoint_dir(opts: LaunchOptions) -> str | None:
    """Where restarts look for checkpoints (absolute), or None when the run saves none we know of."""
    d = opts.checkpoint_dir or script_save_dir(opts.args)
    return os.path.abspath(d) if d else None
