"""``python -m viz [plan.json [timeline.json [measured.json]]]``: start the dashboard on 127.0.0.1.

``python -m viz [--launcher mpiexec] [--prepare-only] --run SCRIPT [args]`` first traces
SCRIPT's plan and runs a few steps with the timeline recorded into ``./mpipar-run/``
(``viz.run_dir``), then opens the dashboard on both.

``mpipar viz`` runs this module as a subprocess. It runs ``streamlit run viz/app.py`` with the
server bound to ``--address`` (default 127.0.0.1: only this machine can connect), headless
(no browser is opened for you; open the printed URL), without usage statistics and in
Streamlit's viewer toolbar mode (no "Deploy" button), and hands the files to the app.
``--address 0.0.0.0`` exposes the dashboard to the network on purpose.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from mpipar import cliargs
from viz.run_dir import DEFAULT_DIR, LAUNCHERS, RunFailed, prepare_run

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")


def streamlit_command(files: Sequence[str], address: str = "127.0.0.1", port: int | None = None) -> list[str]:
    """The command line that serves the dashboard (also used by the browser test)."""
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        APP,
        "--server.address",
        address,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]
    if port is not None:
        cmd += ["--server.port", str(port)]
    if files:
        cmd += ["--", *files]
    return cmd


def run_directory(text: str) -> str:
    """An argparse type: a directory to (re)use, or one to create whose parent exists and is writable."""
    if not text or "\x00" in text or len(text) > 4096:
        raise argparse.ArgumentTypeError(f"{text!r:.80} is not a directory path")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    target = text if os.path.isdir(text) else os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(target):
        raise argparse.ArgumentTypeError(f"{text}: the directory {target} does not exist")
    if not os.access(target, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {target} is not writable")
    return text


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--run SCRIPT [args]`` and its options (shared with ``mpipar viz``); ``--run`` comes last."""
    parser.add_argument(
        "--run-dir",
        default=DEFAULT_DIR,
        type=run_directory,
        help=f"with --run: where the plan, measured timeline and log go (default ./{DEFAULT_DIR}/)",
    )
    parser.add_argument(
        "--steps",
        type=cliargs.int_range(1, 10_000, "a step count"),
        default=3,
        help="with --run: measured training steps, unless the script's arguments give --steps",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="sim",
        help="with --run: the simulator (every rank here) or mpiexec (a process per rank)",
    )
    parser.add_argument("--shape-only", action="store_true", help="with --run: trace the plan shape-only")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="with --run: write the run directory and print the dashboard command; start no server",
    )
    parser.add_argument(
        "--run",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT ARGS",
        help="trace SCRIPT's plan, run a few measured steps, open the dashboard on both (last option)",
    )


def prepare_files(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The files to open: those given, or those ``--run`` prepares."""
    if ns.run is None:
        if len(ns.files) > 3:
            parser.error(f"at most 3 files (a plan and two timelines), got {len(ns.files)}")
        for path in ns.files:
            if not os.path.isfile(path):
                parser.error(f"{path}: no such file")
        return [os.path.abspath(p) for p in ns.files]
    if ns.files:
        parser.error(f"--run prepares its own files: give either files ({' '.join(ns.files)}) or --run")
    if not ns.run:
        parser.error("--run needs a script, e.g. --run examples/gpt.py --mesh dp=2,tp=2 --tiny")
    try:
        run = prepare_run(ns.run[0], ns.run[1:], ns.run_dir, ns.steps, ns.launcher, ns.shape_only, echo=print)
    except RunFailed as exc:
        parser.error(str(exc))
    return [os.path.abspath(run.plan), os.path.abspath(run.timeline)]


def exposure_warning(address: str) -> str | None:
    """A warning when ``address`` lets other machines reach the dashboard, else None.

    Only loopback addresses (127.0.0.0/8, ::1, ``localhost``) keep it on this machine; an empty
    address, 0.0.0.0 and :: mean every interface, and any other address one the network sees.
    The dashboard runs scripts on request (re-trace, what-if), so exposing it is a choice to say
    out loud."""
    text = address.strip()
    if text.lower() == "localhost":
        return None
    try:
        if ipaddress.ip_address(text.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass
    where = "every network interface" if text in ("", "0.0.0.0", "::", "[::]") else f"the address {text!r}"
    return (
        f"mpipar viz: WARNING: --address {text!r} makes the dashboard listen on {where}: other machines that "
        "can reach this one can open it, load files into it and re-trace scripts on this machine. "
        "Use --address 127.0.0.1 (the default) unless that is what you want."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = cliargs.Parser(prog="mpipar viz", description="Open plans and timelines in the mpipar dashboard.")
    parser.add_argument("files", nargs="*", help="plan.json, then optional timeline.json and measured timeline")
    parser.add_argument("--address", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument(
        "--port", type=cliargs.port, default=None, help="port (default: Streamlit's, 8501 or the next free)"
    )
    add_run_arguments(parser)
    ns = parser.parse_args(argv)
    warning = exposure_warning(ns.address)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    files = prepare_files(ns, parser)
    if ns.prepare_only:
        print(f"open them with: {shlex.join(streamlit_command(files, ns.address, ns.port))}")
        return 0
    try:
        return subprocess.call(streamlit_command(files, ns.address, ns.port), stdin=subprocess.DEVNULL)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
