"""A file's text is data: names reach a terminal escaped, never as control sequences.

The probe's case: ``python -m mpipar.checkpoint`` printed tensor names raw, so an escape
sequence in a name cleared the screen or retitled the terminal, and a newline forged a line
of the listing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpipar as dist
from mpipar.checkpoint import save_state_dict
from mpipar.untrusted import printable
from simulator import SimBackend

REPO = Path(__file__).resolve().parents[2]
HOSTILE = {
    "\x1b[2J\x1b]0;pwned\x07w": "\\x1b[2J\\x1b]0;pwned\\x07w",
    "b\n  forged 8 B": "b\\x0a  forged 8 B",
    "c\u202eevil": "c\\u202eevil",
    "d\ud800": "d\\ud800",
}


def test_printable_escapes_what_a_terminal_acts_on() -> None:
    for raw, shown in HOSTILE.items():
        assert printable(raw) == shown
    assert printable("plain ümlaut 名前 and spaces") == "plain ümlaut 名前 and spaces"
    assert printable("two\nlines", keep_newlines=True) == "two\nlines"
    assert printable("\x7f\x85\u2028") == "\\x7f\\x85\\u2028"


def test_the_checkpoint_listing_escapes_names_from_the_file(tmp_path: Path) -> None:
    storable = {k: v for k, v in HOSTILE.items() if k != "d\ud800"}  # UTF-8 cannot hold a lone surrogate
    with dist.use_backend(SimBackend(1)):
        save_state_dict({name: np.arange(2.0) for name in storable}, str(tmp_path / "ck"))
        with pytest.raises(ValueError, match=r"state key 'd\\\\ud800' under '<root>' holds a lone surrogate"):
            save_state_dict({"d\ud800": 1}, str(tmp_path / "bad"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    run = subprocess.run(
        [sys.executable, "-m", "mpipar.checkpoint", str(tmp_path / "ck")],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout.decode("utf-8")
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert len(lines) == 1 + 2 * len(storable)  # a header, then a tensor line and a chunk line each
    for shown in storable.values():
        assert any(line.startswith(f"  {shown} float64[2]") for line in lines), (shown, lines)
