"""Placements: value semantics, repr/str, parsing, Paddle's reduce-type names, errors."""

from __future__ import annotations

import pytest

import mpipar as dist
from mpipar.placement import placements_str


def test_repr_and_str() -> None:
    assert repr(dist.Shard(0)) == "Shard(dim=0)"
    assert str(dist.Shard(2)) == "S(2)"
    assert repr(dist.Replicate()) == "Replicate()" and str(dist.Replicate()) == "R"
    assert repr(dist.Partial()) == "Partial(reduce_type='sum')"
    assert str(dist.Partial("max")) == "P(max)"


def test_frozen_and_hashable() -> None:
    assert dist.Shard(1) == dist.Shard(1) and dist.Shard(1) != dist.Shard(0)
    assert len({dist.Shard(1), dist.Shard(1), dist.Replicate(), dist.Replicate(), dist.Partial()}) == 3
    with pytest.raises(AttributeError):
        dist.Shard(1).dim = 2  # type: ignore[misc]


def test_paddle_reduce_type_names() -> None:
    assert dist.Partial(dist.ReduceType.kRedAvg) == dist.Partial("avg")
    assert dist.Partial("ReduceType.kRedMax").reduce_type == "max"


def test_parse_round_trip() -> None:
    for text in ["S(0)R", "[S(1), P(sum)]", "RRP(min)", "P"]:
        parsed = dist.parse_placements(text)
        assert dist.parse_placements(placements_str(parsed)) == parsed
    assert dist.parse_placements("S(0)P(avg)R") == [dist.Shard(0), dist.Partial("avg"), dist.Replicate()]


def test_errors() -> None:
    with pytest.raises(ValueError, match="reduce_type must be one of sum, avg, max, min, got 'prod'"):
        dist.Partial("prod")
    with pytest.raises(TypeError, match="needs an int tensor dim"):
        dist.Shard("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot parse placements"):
        dist.parse_placements("S(0)Q")
