"""Print a checkpoint's tensors, layouts and chunks: ``python -m mpipar.checkpoint PATH``.

Exit status as every mpipar CLI: 0 on success, 2 for bad input (a usage error, or a path
that is not a loadable checkpoint: the one-line error names the file, field and value), 1
when the system fails us (an I/O error reading a checkpoint that looked sound)."""

from __future__ import annotations

import sys

from mpipar.checkpoint import CheckpointError, describe_checkpoint
from mpipar.untrusted import printable


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m mpipar.checkpoint PATH", file=sys.stderr)
        return 2
    try:
        print(describe_checkpoint(args[0]))
    except CheckpointError as exc:
        print(f"python -m mpipar.checkpoint: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"python -m mpipar.checkpoint: cannot read {printable(args[0])}: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _one_line(exc: BaseException) -> str:
    """The error on one line, with whatever it quotes from the file made terminal-safe."""
    return printable(" ".join(str(exc).split()))


if __name__ == "__main__":
    sys.exit(main())
