"""Print a checkpoint's tensors, layouts and chunks: ``python -m mpipar.checkpoint PATH``."""

from __future__ import annotations

import sys

from mpipar.checkpoint import CheckpointError, describe_checkpoint


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m mpipar.checkpoint PATH", file=sys.stderr)
        return 2
    try:
        print(describe_checkpoint(args[0]))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
