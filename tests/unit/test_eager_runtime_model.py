"""Pricing mpipar's own eager runtime (a calibrated CPU profile, ``HardwareProfile.prices_eager_runtime``):
every micro-batch's gradients are reduced in its own backward, hand-offs hold both ranks until
done, and ``--auto`` prices the gradient clipping the script runs. The GPU presets keep the
once-per-step reduction and posted hand-offs."""

from __future__ import annotations

from dataclasses import replace

import pytest

import mpipar as dist
from mpipar.pipeline import build_schedule
from simulator.auto import choose
from simulator.backend import ShapeOnlyBackend
from simulator.cost import PipelineCost, load_profile
from simulator.estimate import estimate
from simulator.schedule_sim import simulate_schedule
from simulator.step_trace import GPTShape, GPTStrategy

EAGER = replace(
    load_profile("cpu-local"),
    gemm_curve=((1e5, 0.2), (1e7, 0.8), (1e9, 1.0)),
    vector_curve=((1e4, 2e9), (1e6, 1e9), (1e8, 2.5e8)),
    op_overhead_s=2e-4,
    reshard_overhead_s=5e-4,
    update_overhead_s=3e-5,
)
# The same rates, but no measured host costs in the profile: it does not price the eager runtime.
# Passing EAGER's host costs to ``estimate`` explicitly gives both the same op and reshard prices.
PLAIN = replace(EAGER, op_overhead_s=0.0, reshard_overhead_s=0.0, update_overhead_s=0.0)
SAME_COSTS = {"op_overhead": 2e-4, "reshard_overhead": 5e-4, "update_overhead": 3e-5}
SHAPE = GPTShape(4, 128, 4, seq=64, vocab=128, micro_batch_size=2)


def test_which_profiles_price_the_eager_runtime() -> None:
    assert EAGER.prices_eager_runtime
    assert not PLAIN.prices_eager_runtime
    for preset in ("h100-nvlink-ib", "a100-nvlink-ib", "cpu-local"):
        assert not load_profile(preset).prices_eager_runtime, preset


@pytest.mark.parametrize("schedule", ["1F1B", "ZBH1"])
def test_every_micro_batch_reduces_its_gradients_in_its_backward(schedule: str) -> None:
    st = GPTStrategy(dp=2, tp=1, pp=2, micro_batches=2, schedule=schedule)
    with dist.use_backend(ShapeOnlyBackend()):
        eager = estimate(SHAPE, st, EAGER)
        plain = estimate(SHAPE, st, PLAIN, **SAME_COSTS)
    for s, (e, p) in enumerate(zip(eager.stages, plain.stages, strict=True)):
        assert e.forward_s == pytest.approx(p.forward_s, rel=1e-12), s
        assert e.backward_input_s == pytest.approx(p.backward_input_s, rel=1e-12), s
        sync = plain.tail_s[s] - eager.tail_s[s]  # the tail keeps only the optimizer step
        assert sync > 0, s
        # ... and the reduction is part of every micro-batch's weight-gradient pass instead.
        assert e.backward_weight_s == pytest.approx(p.backward_weight_s + sync, rel=1e-9), s
    # Paid once per micro-batch, not once per step: two micro-batches cost more than the plain price.
    assert eager.step_time_s > plain.step_time_s


def test_one_micro_batch_without_a_pipeline_costs_the_same_either_way() -> None:
    """One stage, one micro-batch: the reduction runs once after backward in both readings."""
    st = GPTStrategy(dp=4, tp=2, pp=1)
    with dist.use_backend(ShapeOnlyBackend()):
        eager = estimate(SHAPE, st, EAGER)
        plain = estimate(SHAPE, st, PLAIN, **SAME_COSTS)
    assert eager.step_time_s == pytest.approx(plain.step_time_s, rel=1e-9)


def test_a_blocking_hand_off_holds_the_sender_until_the_receiver_posts() -> None:
    """ZBH1 over 2 stages: stage 0 runs W of micro-batch 0 before it receives micro-batch 1's
    gradient, so stage 1's send of that gradient waits for it; posted, stage 1 goes on."""
    schedule = build_schedule("ZBH1", 2, 2)
    parts = ((1.0, 1.0), (1.0, 1.0), (5.0, 0.5), (0.1,), (0.1,))
    posted = simulate_schedule(schedule, PipelineCost(*parts, "s"))
    held = simulate_schedule(schedule, PipelineCost(*parts, "s", blocking_transfers=True))
    assert held.makespan > posted.makespan
    for tl in (posted, held):
        assert sum(tl.busy(r) for r in tl.ranks) == pytest.approx(2 * (1 + 1 + 5) + 2 * (1 + 1 + 0.5))
    # Held: no rank starts computing between posting a send and the end of its transfer.
    for rank in held.ranks:
        computes = [s for s in held.lane(rank, "compute")]
        for send in (s for s in held.lane(rank, "comm") if s.kind == "SEND"):
            before = max((c.end for c in computes if c.end <= send.start), default=0.0)
            assert not any(before <= c.start < send.end for c in computes), (rank, send)


def test_auto_prices_the_gradient_clipping_the_script_runs() -> None:
    shape = GPTShape(4, 128, 4, 64, 128, 1, 0.0)
    limit = 1 << 34
    clipped = choose(shape, 4, 8, EAGER, top_k=1, limit_bytes=limit, grad_clip=1.0)
    bare = choose(shape, 4, 8, EAGER, top_k=1, limit_bytes=limit)
    assert clipped.ranked[0].strategy.grad_clip == 1.0
    assert bare.ranked[0].strategy.grad_clip is None
    # Clipping adds a global-norm pass over every gradient: never faster.
    assert clipped.ranked[0].step_time_s > bare.ranked[0].step_time_s
