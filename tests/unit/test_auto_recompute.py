"""``--auto``'s search (``simulator.auto.choose``) covers recompute: a memory limit that only
recomputing strategies meet picks one, and the dominance rule that keeps the larger space fast
(``search(drop_dominated=True)``) never changes the best strategy.

The model is ``examples/gpt.py --tiny``'s (4 layers, hidden 16, 2 heads, sequence 16, vocabulary
128) on two ranks, global batch 8, priced on the ``cpu-local`` preset in float32. Its smallest
peaks per rank (measured with this search, no limit): recompute none 196,096 bytes, selective
186,880, full 152,832; 170,000 bytes therefore admits only full recompute.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import mpipar as dist
from simulator.auto import choose
from simulator.backend import ShapeOnlyBackend
from simulator.cost import load_profile
from simulator.search import search
from simulator.step_trace import GPTShape

TINY = GPTShape(4, 16, 2, 16, 128, 1, 0.1)
ONLY_FULL_FITS = 170_000


def test_a_limit_only_recompute_meets_picks_recompute() -> None:
    hw = load_profile("cpu-local")
    result = choose(TINY, 2, 8, hw, limit_bytes=ONLY_FULL_FITS)
    assert result.memory_limit == ONLY_FULL_FITS and len(result.ranked) == 2
    assert [c.strategy.recompute for c in result.ranked] == ["full", "full"]
    assert all(c.fits and c.peak_bytes <= ONLY_FULL_FITS for c in result.ranked)
    with dist.use_backend(ShapeOnlyBackend()):
        lighter = search(
            TINY,
            2,
            8,
            hw,
            memory_limit=ONLY_FULL_FITS,
            top_k=2,
            mixed_precision=False,
            recomputes=("none", "selective"),
        )
    assert lighter.ranked == [] and "--recompute full" in lighter.advice()
    # Without a limit nothing needs recompute: the fastest recomputes nothing.
    assert choose(TINY, 2, 8, hw).ranked[0].strategy.recompute == "none"


def test_dropping_dominated_recompute_keeps_the_best_and_lists_distinct_layouts() -> None:
    hw = load_profile("cpu-local")
    with dist.use_backend(ShapeOnlyBackend()):
        space = {"mixed_precision": False, "schedules": ("1F1B", "ZBH1"), "micro_batch_sizes": (1, 2)}
        every = search(TINY, 2, 8, hw, memory_limit=1 << 40, top_k=3, **space)
        pruned = search(TINY, 2, 8, hw, memory_limit=1 << 40, top_k=3, drop_dominated=True, **space)
    assert pruned.ranked[0] == every.ranked[0]
    assert pruned.priced < every.priced and pruned.pruned["the same strategy with less recompute fits (dominated)"] > 0
    layouts = [(replace(c.strategy, recompute="none"), c.micro_batch_size) for c in pruned.ranked]
    assert len(set(layouts)) == len(layouts) == 3


def test_choose_refuses_a_limit_that_is_not_bytes() -> None:
    hw = load_profile("cpu-local")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=f"memory limit must be a positive number of bytes, got {bad!r}"):
            choose(TINY, 2, 8, hw, limit_bytes=bad)  # type: ignore[arg-type]
