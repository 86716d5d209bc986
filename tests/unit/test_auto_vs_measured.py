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


def test_auto_step_pools_only_the_runs_of_the_same_command() -> None:
    flags = ["--mesh", "dp=2,tp=1,pp=4", "--schedule", "ZBH1"]
    rows = [
        avm.Row("dp=2,tp=1,pp=4", flags, 0.5, measured_s=0.58),
        avm.Row("dp=8,tp=1,pp=1", ["--mesh", "dp=8,tp=1,pp=1"], 0.9, measured_s=0.55),
    ]
    step, same = avm.auto_step_of(0.74, flags, rows)
    assert step == 0.58 and same is rows[0]
    # Another schedule on the same layout is another command: --auto's own run stands.
    step, same = avm.auto_step_of(0.74, ["--mesh", "dp=2,tp=1,pp=4", "--schedule", "1F1B"], rows)
    assert step == 0.74 and same is None
