"""The type checker runs over mpipar, simulator and viz (``[tool.mypy]`` in pyproject.toml).

Errors are compared with the committed baseline ``tests/golden/mypy_baseline.txt`` by file, error
code and message (not line, which any edit above moves): a new error fails, and so does a
baseline entry that no longer occurs, so the baseline only shrinks. The core modules (mesh,
placement, spec, reshard, spmd, ops, autograd, tape) have none at all.

    .venv/bin/python tests/unit/test_types.py --update     # rewrite the baseline after fixing errors
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASELINE = os.path.join(REPO, "tests", "golden", "mypy_baseline.txt")
CORE = ("mpipar/mesh.py", "mpipar/placement.py", "mpipar/spec.py", "mpipar/_tape.py", "mpipar/autograd.py")
CORE_FOLDERS = ("mpipar/reshard/", "mpipar/spmd/", "mpipar/ops/")
ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)\s+\[(?P<code>[a-z-]+)\]$")


def run_mypy() -> Counter[str]:
    """Each error as ``path [code] message``, counted."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--hide-error-context", "--no-pretty"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode not in (0, 1):
        raise RuntimeError(f"mypy failed to run (exit {out.returncode}):\n{out.stderr}\n{out.stdout[-2000:]}")
    found: Counter[str] = Counter()
    for line in out.stdout.splitlines():
        m = ERROR.match(line)
        if m:
            found[f"{m['path']} [{m['code']}] {m['message']}"] += 1
    return found


def read_baseline() -> Counter[str]:
    with open(BASELINE, encoding="utf-8") as f:
        return Counter(line.rstrip("\n") for line in f if line.strip() and not line.startswith("#"))


def test_the_error_pattern_reads_mypy_lines() -> None:
    m = ERROR.match('mpipar/x.py:12: error: "A" has no attribute "b"  [attr-defined]')
    assert m is not None and (m["path"], m["code"], m["message"]) == (
        "mpipar/x.py",
        "attr-defined",
        '"A" has no attribute "b"',
    )


@pytest.fixture(scope="module")
def errors() -> Counter[str]:
    return run_mypy()


def test_core_modules_type_check_clean(errors: Counter[str]) -> None:
    core = sorted(e for e in errors if e.split(" ")[0] in CORE or e.startswith(CORE_FOLDERS))
    assert not core, "type errors in core modules:\n" + "\n".join(core)


def test_type_errors_only_shrink_from_the_baseline(errors: Counter[str]) -> None:
    baseline = read_baseline()
    new = sorted((errors - baseline).elements())
    fixed = sorted((baseline - errors).elements())
    assert not new, "new type errors (fix them):\n" + "\n".join(new)
    assert not fixed, (
        "these baseline errors are gone: shrink the baseline with `python tests/unit/test_types.py --update`:\n"
        + "\n".join(fixed)
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit(__doc__)
    found = run_mypy()
    with open(BASELINE, "w", encoding="utf-8") as f:
        f.write("# mypy errors still to fix (tests/unit/test_types.py); this list may only shrink.\n")
        f.writelines(f"{e}\n" for e in sorted(found.elements()))
    print(f"{sum(found.values())} errors in the baseline")
