"""``benchmarks/auto_vs_measured.py``'s bookkeeping: the layouts it measures, the ranks and their
Spearman correlation it prints (the benchmark itself runs gpt.py under mpiexec for minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import auto_vs_measured as avm


def test_valid_layouts_are_every_split_of_8_ranks_the_default_model_divides_into() -> None:
    layouts = avm.valid_layouts()
    assert len(layouts) == 8 and len(set(layouts)) == 8
    for text in layouts:
        d = {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
        assert d["dp"] * d["tp"] * d["pp"] == 8 and 4 % d["tp"] == 0 and 4 % d["pp"] == 0


def test_ranks_and_rank_correlation() -> None:
    assert avm.rank_of([0.3, 0.1, 0.2]) == [3, 1, 2]
    same = avm.rank_of([1.0, 2.0, 3.0, 4.0])
    assert avm.rank_correlation(same, same) == 1.0
    assert avm.rank_correlation(same, same[::-1]) == -1.0
    # The order the issue saw: predicted ranks 1..8 measured 2,4,1,8,3,6,5,7.
    rho = avm.rank_correlation(list(range(1, 9)), [2, 4, 1, 8, 3, 6, 5, 7])
    assert rho == pytest.approx(1 - 6 * (1 + 4 + 4 + 16 + 4 + 0 + 4 + 1) / (8 * 63))
    assert avm.rank_correlation([1], [1]) == 1.0


def test_layout_of_reads_the_mesh_flag() -> None:
    assert avm.layout_of(["--mesh", "dp=2,tp=2,pp=2", "--micro-batches", "2"]) == "dp=2,tp=2,pp=2"
    with pytest.raises(ValueError, match="no --mesh"):
        avm.layout_of(["--auto"])
