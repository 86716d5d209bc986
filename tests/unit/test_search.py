"""Strategy search: ranking, memory pruning and accounting, for any monotone cost model."""

from __future__ import annotations

import pytest

from simulator.estimate import estimate
from simulator.search import enumerate_strategies, search
from simulator.step_trace import GPTShape

SHAPE = GPTShape(4, 64, 4, seq=32, vocab=128)
SPACE = {"zero_stages": (0,), "recomputes": ("none",), "schedules": ("1F1B",)}


def test_search_ranks_every_fitting_candidate_by_predicted_time() -> None:
    result = search(SHAPE, 2, 4, "a100-nvlink-ib", top_k=1000, **SPACE)
    assert result.ranked, "a tiny model must fit an A100"
    times = [c.step_time_s for c in result.ranked]
    assert times == sorted(times)
    assert all(c.peak_bytes <= result.memory_limit for c in result.ranked)
    assert len(result.ranked) + len(result.over_memory) == result.priced
    best = result.ranked[0]
    sized = GPTShape(4, 64, 4, 32, 128, best.micro_batch_size)
    assert estimate(sized, best.strategy, "a100-nvlink-ib").step_time_s == pytest.approx(best.step_time_s)


def test_enumeration_only_yields_divisible_strategies() -> None:
    pruned: dict[str, int] = {}
    got = list(enumerate_strategies(SHAPE, 8, 6, pruned))
    assert got
    for st, mbs in got:
        assert st.dp * st.tp * st.pp == 8
        assert SHAPE.heads % st.tp == 0 and SHAPE.layers % (st.pp * st.chunks) == 0
        assert st.dp * st.micro_batches * mbs == 6
    assert pruned["batch not divisible by dp"] > 0


def test_nothing_fits_says_by_how_much_and_which_knob() -> None:
    result = search(SHAPE, 2, 4, "a100-nvlink-ib", memory_limit=1, **SPACE)
    assert result.ranked == []
    assert result.pruned["over the memory limit"] == result.priced
    assert "GiB over" in result.advice() and "try" in result.advice()


def test_bad_devices_is_a_named_error() -> None:
    with pytest.raises(ValueError, match="devices"):
        search(SHAPE, 0, 4)
