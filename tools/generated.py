"""Pages generated from the code: write one, or check that the committed copy is current.

``tools/cli_reference.py`` (docs/cli.md) and ``benchmarks/results.py`` (benchmarks/RESULTS.md)
share this command line: no flag writes the page, ``--check`` exits 1 when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def write_or_check(page: str, render: Callable[[], str], description: str, argv: list[str] | None = None) -> int:
    """Parse ``--check``; then compare ``page`` with ``render()`` (status 1 if they differ) or write it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what would be written")
    ns = ap.parse_args(argv)
    text = render()
    if ns.check:
        try:
            with open(page, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"{page} is stale: run {sys.argv[0]} to rewrite it", file=sys.stderr)
            return 1
        return 0
    with open(page, "w", encoding="utf-8") as f:
        f.write(text)
    return 0
