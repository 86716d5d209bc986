"""The search is right: for Narayanan et al. 2021 Table 1 rows
(``simulator.published_configs``), the best strategy it finds is predicted at least as fast as the
published layout priced by the same estimator, and it fits in memory."""

from __future__ import annotations

import os

import pytest

from simulator.cost import load_profile
from simulator.estimate import estimate
from simulator.fast_estimate import TraceCache
from simulator.published_configs import NARAYANAN_2021_TABLE_1, PublishedRun
from simulator.search import search

HW = load_profile("a100-nvlink-ib")
# Every dp x tp x pp and sequence-parallel choice with the published layouts' other knobs and
# micro-batches of 1 or 2 (the whole space is benchmarks/search_vs_published.py's: slow here).
SPACE = {
    "zero_stages": (0,),
    "recomputes": ("selective",),
    "schedules": ("1F1B", "Interleaved1F1B"),
    "micro_batch_sizes": (1, 2),
}


def _check(row: PublishedRun) -> None:
    published = row.strategy()
    cache = TraceCache(HW)
    priced = cache.estimate(row.shape(1), published)
    if priced is None:
        est = estimate(row.shape(1), published, HW)
        step, peak = est.step_time_s, max(est.peak_bytes_per_rank.values())
    else:
        step, peak = priced.step_time_s, priced.peak_bytes
    result = search(row.shape(1), row.gpus, row.batch, HW, top_k=1, **SPACE)
    assert result.ranked, f"{row.billions}B: nothing fits ({result.advice()})"
    best = result.ranked[0]
    assert best.fits and best.peak_bytes <= HW.memory_bytes
    assert best.step_time_s <= step * (1 + 1e-9), (
        f"{row.billions}B: the search's best ({best.step_time_s:.4f} s, {best.strategy}) is slower than the "
        f"published tp={row.tp}, pp={row.pp}, dp={row.dp} ({step:.4f} s, peak {peak / 2**30:.1f} GiB)"
    )


@pytest.mark.parametrize("row", NARAYANAN_2021_TABLE_1[:2], ids=lambda r: f"{r.billions}B")
def test_search_is_never_slower_than_the_published_layout(row: PublishedRun) -> None:
    _check(row)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MPIPAR_SLOW") != "1",
    reason="searches 128 to 1536 GPUs: on demand, MPIPAR_SLOW=1 pytest -m slow tests/unit/test_search_published.py",
)
@pytest.mark.parametrize("row", NARAYANAN_2021_TABLE_1[2:7], ids=lambda r: f"{r.billions}B")
def test_search_is_never_slower_than_the_published_layout_larger(row: PublishedRun) -> None:
    _check(row)
