"""``python -m viz [plan.json [timeline.json [measured.json]]]``: start the dashboard on 127.0.0.1.

``mpipar viz`` runs this module as a subprocess. It runs ``streamlit run viz/app.py`` with the
server bound to ``--address`` (default 127.0.0.1: only this machine can connect), headless
(no browser is opened for you; open the printed URL), without usage statistics and in
Streamlit's viewer toolbar mode (no "Deploy" button), and hands the files to the app.
``--address 0.0.0.0`` exposes the dashboard to the network on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from mpipar import cliargs

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")


def streamlit_command(files: Sequence[str], address: str = "127.0.0.1", port: int | None = None) -> list[str]:
    """The command line that serves the dashboard (also used by the browser test)."""
    cmd = [sys.executable, "-m", "streamlit", "run", APP, "--server.address", address, "--server.headless", "true",
           "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"]
    if port is not None:
        cmd += ["--server.port", str(port)]
    if files:
        cmd += ["--", *files]
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    parser = cliargs.Parser(prog="mpipar viz", description="Open plans and timelines in the mpipar dashboard.")
    parser.add_argument("files", nargs="*", help="plan.json, then optional timeline.json and measured timeline")
    parser.add_argument("--address", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=cliargs.port, default=None, help="port (default: Streamlit's, 8501 or the next free)")
    ns = parser.parse_args(argv)
    if len(ns.files) > 3:
        parser.error(f"at most 3 files (a plan and two timelines), got {len(ns.files)}")
    for path in ns.files:
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
    files = [os.path.abspath(p) for p in ns.files]
    try:
        return subprocess.call(streamlit_command(files, ns.address, ns.port), stdin=subprocess.DEVNULL)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
