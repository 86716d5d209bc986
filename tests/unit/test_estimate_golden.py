"""``python -m simulator estimate --json`` gives, for every pinned command line, exactly the
output recorded in ``tests/golden/estimate/cases.json`` (floats compared bit for bit)."""

from __future__ import annotations

import json

import pytest

from tests.unit.estimate_golden_cases import CASES, GOLDEN, run_case

with open(GOLDEN) as _f:
    RECORDED = json.load(_f)


def test_golden_file_covers_every_case() -> None:
    assert sorted(RECORDED) == sorted(CASES)
    for name, argv in CASES.items():
        assert RECORDED[name]["argv"] == argv, f"{name}: the command line changed; record the golden again"


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_json_matches_golden(name: str) -> None:
    assert run_case(CASES[name]) == RECORDED[name]["output"]
