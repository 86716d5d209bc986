"""``python -m simulator``: run a script on virtual ranks, or as the one-big-device reference.

    python -m simulator -n 8 train.py [args]     # a world of 8 virtual ranks, one process
    python -m simulator --reference train.py     # one big device: no placement, no communication
    python -m simulator train.py                 # every rank of every mesh the script builds

Subcommands (a first argument naming one, unless a file of that name exists):

    python -m simulator calibrate [-o profile.json]            # measure this machine
    python -m simulator schedule 1F1B -p 4 -m 8 [--chrome t.json]  # pipeline grid + bubble
    python -m simulator estimate --params 175e9 --mesh dp=8,tp=8,pp=16 ...  # memory and step time
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mpipar import cliargs
from simulator.backend import ReferenceBackend, SimBackend
from simulator.launch import run_script, run_script_per_rank, uses_manual_api

# name -> "module:function"; the function takes the remaining argv and returns an exit code.
# A new subcommand (e.g. estimate) is one more entry here.
SUBCOMMANDS: dict[str, str] = {
    "calibrate": "simulator.calibrate:main",
    "estimate": "simulator.estimate:main",
    "schedule": "simulator.schedule_sim:main",
    "search": "simulator.search:main",
}


MAX_PER_RANK_PROGRAMS = 4096
"""Per-rank programs are one thread each, all alive at once; past this the process would run
out of threads or memory long before the first collective (semi-automatic scripts, one
program hosting every rank, go to a world of 2^20)."""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in SUBCOMMANDS and not os.path.isfile(args[0]):
        module, func = SUBCOMMANDS[args[0]].split(":")
        sys.exit(getattr(importlib.import_module(module), func)(args[1:]))
    parser = cliargs.Parser(
        prog="python -m simulator",
        description="Run an mpipar script on virtual ranks in one process, or as one big device.",
        epilog="subcommands: " + ", ".join(sorted(SUBCOMMANDS)) + " (python -m simulator SUBCOMMAND -h)",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        type=cliargs.int_range(1, cliargs.MAX_WORLD, "a world size"),
        default=None,
        help="size of the virtual world",
    )
    parser.add_argument("--reference", action="store_true", help="run as one big device (the equivalence oracle)")
    parser.add_argument(
        "--per-rank",
        action="store_true",
        help="run one program per virtual rank (needs -n; chosen automatically for a script that "
        "calls the manual collectives, dist.all_reduce, dist.send, ...)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    ns = parser.parse_args(args)
    if ns.nprocs is not None and ns.nprocs < 1:
        parser.error(f"-n must be at least 1, got {ns.nprocs}")
    if ns.per_rank and (ns.reference or ns.nprocs is None):
        parser.error("--per-rank needs -n N and no --reference (one device has one program)")
    if (
        ns.nprocs is not None
        and not ns.reference
        and (ns.per_rank or (os.path.isfile(ns.script) and uses_manual_api(ns.script)))
    ):
        if ns.nprocs > MAX_PER_RANK_PROGRAMS:
            parser.error(
                f"-n: {ns.nprocs} per-rank programs (one thread each) is over the limit of {MAX_PER_RANK_PROGRAMS}; "
                "run a manual script that large under mpiexec"
            )
        run_script_per_rank(ns.script, ns.args, ns.nprocs)
        return
    backend = ReferenceBackend(ns.nprocs) if ns.reference else SimBackend(ns.nprocs)
    run_script(ns.script, ns.args, backend)


if __name__ == "__main__":
    main(sys.argv[1:])
