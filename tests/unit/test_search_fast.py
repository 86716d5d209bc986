"""The search's fast path: the same numbers as ``estimate``, through shared traces."""

from __future__ import annotations

import pytest

from simulator.cost import load_profile
from simulator.estimate import estimate
from simulator.fast_estimate import TraceCache, applicable
from simulator.search import search, state_lower_bound
from simulator.step_trace import GPTShape, GPTStrategy

HW = load_profile("a100-nvlink-ib")
SHAPE = GPTShape(8, 128, 8, seq=64, vocab=256)

# Different tp, pp, dp, sequence parallelism, recompute, ZeRO stage, schedule and micro-batch size.
CASES = [
    (1, GPTStrategy(2, 2, 2, True, "selective", 1, True, "adamw", 4, "1F1B", 1)),
    (2, GPTStrategy(4, 2, 1, False, "none", 0, True, "adamw", 2, "1F1B", 1)),
    (1, GPTStrategy(1, 4, 4, True, "full", 0, True, "adamw", 8, "Interleaved1F1B", 2)),
    (1, GPTStrategy(4, 2, 2, True, "selective", 3, True, "adamw", 4, "ZBH1", 1)),
    (1, GPTStrategy(2, 1, 4, False, "none", 2, True, "adamw", 6, "FThenB", 1)),
]


def _sized(mbs: int, layers: int = 8) -> GPTShape:
    return GPTShape(layers, SHAPE.hidden, SHAPE.heads, SHAPE.seq, SHAPE.vocab, mbs)


@pytest.mark.parametrize(
    "mbs,strategy",
    CASES,
    ids=lambda c: str(c) if isinstance(c, int) else f"dp{c.dp}-tp{c.tp}-pp{c.pp}-{c.schedule}-z{c.zero}-{c.recompute}",
)
def test_fast_estimate_equals_estimate(mbs: int, strategy: GPTStrategy) -> None:
    shape = _sized(mbs)
    assert applicable(shape, strategy, HW) == ""
    fast = TraceCache(HW).estimate(shape, strategy)
    direct = estimate(shape, strategy, HW)
    assert fast is not None
    assert fast.step_time_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert fast.peak_bytes == max(direct.peak_bytes_per_rank.values())
    assert fast.bubble_fraction == pytest.approx(direct.bubble_fraction, rel=1e-9, abs=1e-12)


def test_long_pipeline_is_extrapolated_exactly() -> None:
    # 20 micro-batches on 3 stages: simulated at 5, 6 and 7 and extrapolated; still estimate's numbers.
    shape = _sized(1, 12)
    strategy = GPTStrategy(2, 2, 3, False, "full", 1, True, "adamw", 20, "1F1B", 1)
    fast = TraceCache(HW).estimate(shape, strategy)
    direct = estimate(shape, strategy, HW)
    assert fast is not None and fast.step_time_s == pytest.approx(direct.step_time_s, rel=1e-9)
    assert fast.peak_bytes == max(direct.peak_bytes_per_rank.values())


def test_one_trace_serves_every_pipeline_and_schedule() -> None:
    cache = TraceCache(HW)
    shape = _sized(1)
    for pp, schedule, m in ((1, "1F1B", 4), (2, "1F1B", 4), (4, "ZBH1", 8), (2, "FThenB", 2)):
        assert (
            cache.estimate(shape, GPTStrategy(2, 2, pp, True, "selective", 0, True, "adamw", m, schedule)) is not None
        )
    assert cache.traces == 1


def test_uneven_node_cut_is_not_reused() -> None:
    # 3-rank tensor-parallel groups on 8-device nodes: some groups straddle two nodes.
    shape = GPTShape(8, 96, 3, 64, 256)
    assert "cut" in applicable(shape, GPTStrategy(1, 3, 2), HW)


def test_state_bound_never_exceeds_the_estimate() -> None:
    for mbs, st in CASES[:2]:
        direct = estimate(_sized(mbs), st, HW)
        assert state_lower_bound(SHAPE, st) <= min(direct.model_state_bytes_per_rank.values())


def test_fast_search_finds_the_exhaustive_best() -> None:
    # Prices 22 candidates with estimate itself: 41 s with the shared machine at load 25.
    space = {"zero_stages": (0,), "recomputes": ("none", "full"), "schedules": ("1F1B",)}
    shape = GPTShape(4, 64, 4, seq=32, vocab=128)
    fast = search(shape, 2, 4, HW, top_k=3, **space)
    slow = search(shape, 2, 4, HW, top_k=3, fast=False, **space)
    assert [c.step_time_s for c in fast.ranked] == pytest.approx([c.step_time_s for c in slow.ranked], rel=1e-9)
    assert [c.peak_bytes for c in fast.ranked] == [c.peak_bytes for c in slow.ranked]
    assert fast.priced < slow.priced, "the bounds must spare some pricing"
