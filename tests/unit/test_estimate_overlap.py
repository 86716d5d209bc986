"""The estimator's model of overlapped gradient reduction (``--overlap-grad-reduce``): only the
part of the reduction that the rest of the last backward cannot hide is added to the step."""

from __future__ import annotations

import json

import pytest

from simulator.estimate import estimate, exposed_grad_sync, main
from simulator.step_trace import GPTShape, GPTStrategy, trace_gpt_step

SHAPE = GPTShape(layers=4, hidden=1024, heads=8, seq=512, vocab=1000, micro_batch_size=4)


def test_exposed_sync_by_hand() -> None:
    # Two layers, 1 s of backward each, 0.5 s of reduction each: the first reduction hides behind
    # the second layer's backward, the second (ready when backward ends) is all exposed.
    assert exposed_grad_sync([(1, 1.0, 0.5), (1, 1.0, 0.5)]) == pytest.approx(0.5)
    # Reductions run one at a time: a long first one delays the second past the end of backward.
    assert exposed_grad_sync([(1, 1.0, 3.0), (1, 1.0, 0.1)]) == pytest.approx(2.1)
    # A traced layer standing for three (times per layer): only the last one's reduction shows.
    assert exposed_grad_sync([(3, 1.0, 0.5)]) == pytest.approx(0.5)
    # 1.5 layers: two pieces of 0.75 s backward and 0.375 s reduction each.
    assert exposed_grad_sync([(1.5, 1.0, 0.5)]) == pytest.approx(0.375)
    assert exposed_grad_sync([(1, 2.0, 0.0), (2, 1.0, 0.0)]) == 0.0
    # Nothing to hide behind: all of it is exposed.
    assert exposed_grad_sync([(1, 0.0, 0.25), (1, 0.0, 0.5)]) == pytest.approx(0.75)


@pytest.mark.parametrize(
    "strategy",
    [GPTStrategy(dp=4), GPTStrategy(dp=2, tp=2), GPTStrategy(dp=2, pp=2, micro_batches=4)],
    ids=["dp4", "dp2tp2", "dp2pp2"],
)
def test_step_time_pays_only_the_exposed_reduction(strategy: GPTStrategy) -> None:
    step = trace_gpt_step(SHAPE, strategy)
    plain = estimate(SHAPE, strategy, "h100-nvlink-ib", step=step)
    over = estimate(SHAPE, strategy, "h100-nvlink-ib", step=step, overlap_grad_reduce=True)
    assert plain.grad_sync_exposed_s is None and over.grad_sync_exposed_s is not None
    assert over.pipeline_s == plain.pipeline_s  # the schedule itself is unchanged
    for lane, (t_plain, t_over, exposed) in enumerate(
        zip(plain.tail_s, over.tail_s, over.grad_sync_exposed_s, strict=True)
    ):
        hidden = t_plain - t_over  # = the lane's whole reduction minus its exposed part
        assert hidden > 0, lane
        assert exposed > 0  # the reduction of what backward reaches last is never hidden
        optimizer = t_over - exposed
        assert optimizer >= 0
    assert over.step_time_s < plain.step_time_s
    if strategy.pp == 1:  # one lane: the step is its backward's end, then its tail
        assert over.step_time_s - plain.step_time_s == pytest.approx(over.tail_s[0] - plain.tail_s[0], rel=1e-9)
    d = over.to_dict()
    assert d["pipeline"]["grad_sync_exposed_s"] == over.grad_sync_exposed_s
    assert "grad_sync_exposed_s" not in plain.to_dict()["pipeline"]


def test_most_of_a_large_reduction_hides_behind_a_long_backward() -> None:
    strategy = GPTStrategy(dp=4)
    step = trace_gpt_step(SHAPE, strategy)
    plain = estimate(SHAPE, strategy, "h100-nvlink-ib", step=step)
    over = estimate(SHAPE, strategy, "h100-nvlink-ib", step=step, overlap_grad_reduce=True)
    assert over.grad_sync_exposed_s is not None
    sync = plain.tail_s[0] - (over.tail_s[0] - over.grad_sync_exposed_s[0])
    assert over.grad_sync_exposed_s[0] < 0.5 * sync


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "96", "--mesh", "dp=2"]
    assert main([*args, "--overlap-grad-reduce", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["pipeline"]["grad_sync_exposed_s"]) == 1
    assert main([*args, "--overlap-grad-reduce"]) == 0
    assert "overlapped with backward" in capsys.readouterr().out
