"""Environment variables are input: one strict parser, every variable declared and documented.

The probe's cases: ``MPIPAR_STACK_GEMMS=false`` left stacked GEMMs on (only "0" turned them
off), ``MPIPAR_BACKEND=bogus`` failed without naming the variable, and ``mpipar viz --address
""`` listened on every interface without a word.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from processes import run_python

from mpipar import backend
from mpipar.env import FALSE_WORDS, TRUE_WORDS, VARIABLES, env_flag
from mpipar.ops import stacked_gemm
from viz.__main__ import exposure_warning

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("word", ["false", "FALSE", "off", "No", " 0 "])
def test_stack_gemms_false_turns_the_feature_off(monkeypatch: pytest.MonkeyPatch, word: str) -> None:
    monkeypatch.setenv("MPIPAR_STACK_GEMMS", word)
    assert stacked_gemm.enabled() is False


def test_every_flag_word_is_read_alike_and_anything_else_is_refused_by_name() -> None:
    for word in TRUE_WORDS + tuple(w.upper() for w in TRUE_WORDS):
        assert env_flag("MPIPAR_AGREE", False, {"MPIPAR_AGREE": word}) is True
    for word in FALSE_WORDS + tuple(w.title() for w in FALSE_WORDS):
        assert env_flag("MPIPAR_AGREE", True, {"MPIPAR_AGREE": word}) is False
    assert env_flag("MPIPAR_AGREE", True, {"MPIPAR_AGREE": "  "}) is True
    for bad in ("2", "enabled", "ja", "0x1"):
        with pytest.raises(ValueError, match=f"MPIPAR_STACK_GEMMS='{bad}' is not a boolean"):
            env_flag("MPIPAR_STACK_GEMMS", True, {"MPIPAR_STACK_GEMMS": bad})


def test_a_bogus_backend_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPIPAR_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"MPIPAR_BACKEND='bogus' names no backend; registered: .*mpi.*sim"):
        backend._auto_name()
    monkeypatch.setenv("MPIPAR_BACKEND", "Sim")
    assert backend._auto_name() == "sim"


def test_every_mpipar_variable_is_read_through_the_one_parser_and_documented() -> None:
    """No module reads an MPIPAR_* variable from os.environ itself; every declared one is in the table."""
    direct = re.compile(
        r"""(os\.environ\.get\(\s*|getenv\(\s*)["']MPIPAR_|os\.environ\[\s*["']MPIPAR_\w+["']\s*\](?!\s*=)"""
    )
    offenders = []
    for folder in ("mpipar", "simulator", "viz"):
        for path in (REPO / folder).rglob("*.py"):
            if path.name != "env.py" and direct.search(path.read_text()):
                offenders.append(str(path.relative_to(REPO)))
    assert offenders == []
    used = set()
    for folder in ("mpipar", "simulator", "viz", "examples"):
        for path in (REPO / folder).rglob("*.py"):
            used |= set(re.findall(r"\bMPIPAR_[A-Z_]+[A-Z]\b", path.read_text()))
    declared = {v.name for v in VARIABLES}
    assert used <= declared, sorted(used - declared)
    table = (REPO / "docs" / "environment.md").read_text()
    for v in VARIABLES:
        assert f"`{v.name}`" in table, v.name


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::", "192.168.1.7", "example.org"])
def test_a_listening_address_other_machines_reach_is_a_warning(address: str) -> None:
    warning = exposure_warning(address)
    assert warning is not None and "WARNING" in warning and repr(address) in warning


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_is_quiet(address: str) -> None:
    assert exposure_warning(address) is None


def test_mpipar_viz_prints_the_warning() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    run = run_python("-m", "mpipar.cli", "viz", "--address", "", "--prepare-only", "--run", env=env, timeout=60)
    assert "WARNING: --address '' makes the dashboard listen on every network interface" in run.stderr
