"""``mpipar launch``: start a training script anywhere, keep per-rank logs, recover by itself.

    mpipar launch -n 4 -- examples/gpt.py --tiny --steps 20
    mpipar launch -n 4 --simulate examples/gpt.py --tiny                 # virtual ranks, one process
    mpipar launch -n 16 --hosts node1:8,node2:8 --dry-run train.py      # the mpiexec line, rank map
    mpipar launch -n 4 --max-restarts 3 examples/gpt.py --tiny --steps 50 --save-every 5 --save-dir ck
    python -m mpipar.distributed.launch --gpus=0,1 --log_dir logs train.py   # Paddle's spelling

* ``options``: the two command lines, parsed into one ``LaunchOptions``.
* ``supervisor``: the command (``mpiexec`` from this Python's environment, or
  ``python -m simulator``), the ranks' environment, attempts and restarts, the summary line.
* ``attempt``: one attempt: per-rank logs (``<log-dir>/attempt-<k>/workerlog.<rank>``), rank 0
  shown live, SIGINT/SIGTERM forwarded, the heartbeat watch that names a hung rank.

The user's guide is ``docs/launching.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mpipar.launch.options import parse, parse_paddle
from mpipar.launch.supervisor import run


def main(argv: Sequence[str] | None = None) -> int:
    """``mpipar launch ...``"""
    return run(parse(sys.argv[1:] if argv is None else argv))


def paddle_main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpipar.distributed.launch ...`` (Paddle's flags)."""
    return run(parse_paddle(sys.argv[1:] if argv is None else argv))


__all__ = ["main", "paddle_main"]
