"""The code blocks of the documentation, so that a test can run them and the docs cannot rot.

A fenced block tagged ``python``, ``bash``, ``sh`` or ``shell`` is code; any other fence
(``text``, none) is output shown to the reader and is not run. A block is skipped when the last
non-blank line before its fence is ``<!-- skip: reason -->`` (the reason is required: a long
multi-host launch, a command that starts a server, ...). ``tests/unit/test_docs.py`` runs each
page's Python blocks in order as one script (later blocks use what earlier ones defined) and
each shell block as its own ``bash -e`` script.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
_FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"^<!--\s*skip:\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str  # "python" or "shell"
    code: str
    skip: str | None  # the reason, when marked to be skipped


def doc_pages() -> list[str]:
    """README.md, CONTRIBUTING.md and every Markdown page under docs/ (relative paths, sorted)."""
    pages = ["README.md", "CONTRIBUTING.md"]
    for root, _dirs, files in os.walk(os.path.join(REPO, "docs")):
        pages += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".md")]
    return sorted(pages)


def blocks(path: str) -> list[Block]:
    """The code blocks of one page, in order."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out: list[Block] = []
    i = 0
    last_text = ""
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                last_text = lines[i].strip()
            i += 1
            continue
        indent, fence, tag = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if tag in LANGS:
            skip = _SKIP.match(last_text)
            out.append(Block(path, start + 1, LANGS[tag], "\n".join(body) + "\n", skip.group(1) if skip else None))
        last_text = ""
    return out
