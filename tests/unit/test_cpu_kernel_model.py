"""The calibrated CPU model: kernel rates by size and host costs in the profile, read as
untrusted input, priced by ``PlanCosts`` for ``estimate`` and its fast path alike."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from simulator import calibrate_host
from simulator.cost import HardwareProfile, Link, load_profile
from simulator.estimate import estimate
from simulator.fast_estimate import TraceCache
from simulator.op_cost import PlanCosts
from simulator.search import search
from simulator.step_trace import SETUP, GPTShape, GPTStrategy, trace_gpt_step

LINK = Link(2e-5, 1e9)
BASE = HardwareProfile("cpu-test", LINK, LINK, {"float32": 4e10, "float64": 2e10}, memory_bytes=1 << 34)
CURVED = replace(
    BASE,
    gemm_curve=((1e5, 0.2), (1e7, 0.8), (1e9, 1.0)),
    vector_curve=((1e4, 2e9), (1e6, 1e9), (1e8, 2.5e8)),
    op_overhead_s=2e-4,
    reshard_overhead_s=5e-4,
    update_overhead_s=3e-5,
)
SHAPE = GPTShape(4, 128, 4, seq=64, vocab=128, micro_batch_size=2)


def test_curves_interpolate_in_log_size_and_level_off_beyond_their_ends() -> None:
    assert CURVED.gemm_efficiency(1e6) == pytest.approx(0.5)  # halfway between 1e5 and 1e7 in log
    assert CURVED.gemm_efficiency(1e3) == 0.2 and CURVED.gemm_efficiency(1e12) == 1.0
    assert CURVED.vector_rate(1e5) == pytest.approx(1.5e9)
    assert CURVED.vector_rate(1.0) == 2e9 and CURVED.vector_rate(1e10) == 2.5e8
    assert BASE.vector_rate(1e5) is None and BASE.gemm_efficiency(1e6) == BASE.compute_efficiency


def test_the_profile_round_trips_through_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    CURVED.save(path)
    back = load_profile(str(path))
    assert back == CURVED
    assert (back.op_overhead_s, back.reshard_overhead_s, back.update_overhead_s) == (2e-4, 5e-4, 3e-5)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("gemm_curve", "fast", "gemm_curve must be a list of"),
        ("gemm_curve", [[1e5, 0.5], [1e4, 0.6]], r"gemm_curve\[1\] x = 10000.0; x must be > 0 and strictly increasing"),
        ("gemm_curve", [[1e5, 1.5]], r"gemm_curve\[0\] y = 1.5; must be a share in \(0, 1\]"),
        ("gemm_curve", [[1e5, 0.5, 1]], r"gemm_curve\[0\] must be \[x, y\]"),
        ("gemm_curve", [[-1, 0.5]], r"gemm_curve\[0\] x = -1"),
        ("vector_curve", [[1e4, 0]], r"vector_curve\[0\] y = 0; must be FLOP/s > 0"),
        ("vector_curve", [[1e4, True]], r"vector_curve\[0\] must be \[x, y\]"),
        ("vector_curve", [[i + 1, 1e9] for i in range(65)], "vector_curve has 65 points, at most 64"),
        ("op_overhead_s", -1e-6, r"op_overhead_s must be seconds in \[0, 1\], got -1e-06"),
        ("update_overhead_s", 5, r"update_overhead_s must be seconds in \[0, 1\], got 5"),
    ],
)
def test_a_bad_profile_file_is_refused_naming_the_field(tmp_path: Path, field: str, value: Any, words: str) -> None:
    data = CURVED.to_dict()
    data[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=words):
        load_profile(str(path))


def test_nan_in_a_curve_is_refused() -> None:
    with pytest.raises(ValueError, match=r"vector_curve\[0\] must be \[x, y\], two finite numbers"):
        replace(BASE, vector_curve=((math.nan, 1e9),))


def test_two_gemm_models_at_once_are_refused() -> None:
    with pytest.raises(ValueError, match="gemm_curve and gemm_efficiency_max are two GEMM models"):
        replace(BASE, gemm_curve=((1e5, 0.5),), gemm_efficiency_max=0.8, memory_Bps=1e11)


def test_each_kernel_is_priced_at_the_rate_of_its_own_size() -> None:
    """A matmul at the GEMM rate times the curve's efficiency at its FLOPs; an elementwise op at
    the vector rate of its bytes; each plus the profile's host cost per op."""
    step = trace_gpt_step(SHAPE, GPTStrategy(), layers_traced=SHAPE.layers)
    costs = PlanCosts(step.plan, CURVED)
    seen = set()
    for op, part in zip(step.plan.ops, step.op_parts, strict=True):
        if part == SETUP or op.phase != "forward" or op.op not in ("matmul", "add", "gelu"):
            continue
        flops = costs.op_flops(op, 0)
        if op.op == "matmul":
            kernel = flops / (4e10 * CURVED.gemm_efficiency(flops))
        else:
            kernel = flops / CURVED.vector_rate(costs.op_bytes(op, 0))  # type: ignore[operator]
        assert costs.op_time(op, 0) == pytest.approx(kernel + 2e-4, rel=1e-12), op.op
        seen.add(op.op)
    assert seen == {"matmul", "add", "gelu"}


def test_an_explicit_vector_rate_and_overhead_still_win() -> None:
    """The benchmark's knobs (``vector_flops``, ``op_overhead``) override the profile's model."""
    step = trace_gpt_step(SHAPE, GPTStrategy(), layers_traced=SHAPE.layers)
    costs = PlanCosts(step.plan, CURVED, vector_flops=1e9, op_overhead=0.0)
    add = next(op for op in step.plan.ops if op.op == "add" and op.phase == "forward")
    assert costs.op_time(add, 0) == pytest.approx(costs.op_flops(add, 0) / 1e9)
    assert costs.reshard_overhead == 0.0  # an op_overhead given alone stands for the reshard call too


def test_estimate_defaults_to_the_profiles_host_costs() -> None:
    strategy = GPTStrategy(dp=2, tp=2, grad_clip=1.0)
    step = trace_gpt_step(SHAPE, strategy, layers_traced=SHAPE.layers)
    implicit = estimate(SHAPE, strategy, CURVED, step=step).step_time_s
    bare = replace(CURVED, op_overhead_s=0.0, reshard_overhead_s=0.0, update_overhead_s=0.0)
    explicit = estimate(
        SHAPE, strategy, bare, op_overhead=2e-4, reshard_overhead=5e-4, update_overhead=3e-5, step=step
    ).step_time_s
    assert implicit == pytest.approx(explicit, rel=1e-12)
    assert implicit > estimate(SHAPE, strategy, bare, step=step).step_time_s + 100 * 2e-4  # hundreds of ops


@pytest.mark.parametrize(
    "strategy",
    [
        GPTStrategy(4, 2, 1, False, "none", 1, False, "adamw", 2, "1F1B", 1),
        GPTStrategy(2, 1, 4, False, "none", 0, False, "adamw", 4, "ZBH1", 1),
        GPTStrategy(1, 2, 2, True, "none", 2, False, "adamw", 2, "1F1B", 1),
    ],
    ids=["dp4-tp2", "dp2-pp4-zbh1", "tp2-pp2-sp-z2"],
)
def test_the_fast_path_prices_the_curves_exactly_as_estimate(strategy: GPTStrategy) -> None:
    shape = GPTShape(4, 128, 4, seq=64, vocab=128, micro_batch_size=2)
    fast = TraceCache(CURVED).estimate(shape, strategy)
    assert fast is not None
    assert fast.step_time_s == pytest.approx(estimate(shape, strategy, CURVED).step_time_s, rel=1e-9)


def test_the_fast_search_on_a_curved_profile_finds_the_exhaustive_best() -> None:
    """The search's lower bound (GEMM FLOPs at the best rate) stays a bound under the curve."""
    shape = GPTShape(4, 128, 4, seq=64, vocab=128, micro_batch_size=1)
    space: dict[str, Any] = {
        "mixed_precision": False,
        "recomputes": ("none",),
        "zero_stages": (0,),
        "schedules": ("1F1B", "ZBH1"),
        "micro_batch_sizes": (1, 4),
    }
    fast = search(shape, 4, 8, CURVED, top_k=3, **space)
    slow = search(shape, 4, 8, CURVED, top_k=3, fast=False, **space)
    assert len(fast.ranked) == 3
    assert [c.strategy for c in fast.ranked] == [c.strategy for c in slow.ranked]
    assert [c.step_time_s for c in fast.ranked] == pytest.approx([c.step_time_s for c in slow.ranked], rel=1e-9)


def test_calibration_bins_gemms_by_size_as_shares_of_the_fastest() -> None:
    points = [
        {"a": [n, n], "b": [n, n], "flops": f, "flops_per_s": r}
        for n, f, r in ((1, 1e5, 1e9), (2, 1.2e5, 3e9), (3, 1e7, 8e9), (4, 1e9, 1e10))
    ]
    peak, curve = calibrate_host.gemm_curve(points)
    assert peak == 1e10
    assert [round(math.log(f, 4)) for f, _ in curve] == [8, 12, 15]
    assert [e for _, e in curve] == pytest.approx([0.2, 0.8, 1.0])  # the first bin: median of 1e9 and 3e9
    with pytest.raises(ValueError, match="no GEMM measurements"):
        calibrate_host.gemm_curve([])


def test_a_kernels_own_time_leaves_out_numpys_call_cost() -> None:
    assert calibrate_host.kernel_seconds(10e-6, 2e-6) == pytest.approx(8e-6)
    assert calibrate_host.kernel_seconds(10e-6, 20e-6) == pytest.approx(1e-6)  # noise: a tenth at least


def test_the_measured_shapes_span_the_model_sizes() -> None:
    flops = [calibrate_host.gemm_flops(a, b) for _, a, b in calibrate_host.gemm_shapes()]
    assert min(flops) <= 1e5 and max(flops) >= 2e8
    assert calibrate_host.gemm_flops((4, 64, 256), (256, 256)) == 2.0 * 4 * 64 * 256 * 256


def test_auto_measures_again_when_the_cached_profile_predates_the_cpu_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache written before the CPU model (no kernel curves, or curves but no kernel probe or
    optimizer-phase op cost) would rank on what this machine's steps do not cost: --auto calibrates again (where it
    can), and keeps a cache that has the whole model."""
    from simulator import auto

    measured_model = replace(
        CURVED,
        kernel_scale=2.5,
        optimizer_op_overhead_s=5e-5,
        grad_sync_s=4e-4,
        calibration={"kernel_probe": {"measured_s": {"2": 0.1, "16": 0.5}}},
    )
    monkeypatch.setenv("HOME", str(tmp_path))
    cached = Path(auto.cache_path(8))
    cached.parent.mkdir(parents=True)
    measured: list[int] = []

    def calibrate_to(path: str, ranks: int, timeout_s: float = 0.0) -> None:
        measured.append(ranks)
        measured_model.save(path)

    monkeypatch.setattr(auto, "calibrate_to", calibrate_to)
    said: list[str] = []
    for old in (BASE, CURVED):
        old.save(cached)
        got = auto.resolve_profile(None, 8, can_calibrate=True, say=said.append)
        assert got.profile == measured_model and got.profile.kernel_scale == 2.5
        assert "predates the measured CPU model" in said[-2]
    assert measured == [8, 8]
    again = auto.resolve_profile(None, 8, can_calibrate=True, say=said.append)
    assert measured == [8, 8] and again.profile == measured_model and "cached calibration" in again.source
    BASE.save(cached)  # where it cannot calibrate, the old cache is still better than the fallback preset
    assert auto.resolve_profile(None, 8, can_calibrate=False, say=said.append).profile == BASE


def test_kernel_scale_multiplies_every_kernel_and_survives_the_file(tmp_path: Path) -> None:
    """``kernel_scale`` slows every kernel priced from the rates (GEMMs, elementwise ops, the
    update) and nothing else: host costs per op and the links stay as they are."""
    scaled = replace(CURVED, kernel_scale=2.5)
    assert scaled.compute_time(1e9, "float32") == pytest.approx(2.5 * CURVED.compute_time(1e9, "float32"))
    assert scaled.vector_rate(1e5) == pytest.approx(CURVED.vector_rate(1e5) / 2.5)
    step = trace_gpt_step(SHAPE, GPTStrategy(), layers_traced=SHAPE.layers)
    plain, slow = PlanCosts(step.plan, CURVED), PlanCosts(step.plan, scaled)
    ops = [op for op, part in zip(step.plan.ops, step.op_parts, strict=True) if part != SETUP]
    for op in ops[:40]:
        host = CURVED.op_overhead_s
        assert slow.op_time(op, 0) - host == pytest.approx(2.5 * (plain.op_time(op, 0) - host))
    path = tmp_path / "p.json"
    scaled.save(path)
    assert load_profile(str(path)).kernel_scale == 2.5
    assert "kernel_scale" not in CURVED.to_dict()  # 1.0 is the default and stays out of the file


@pytest.mark.parametrize("value", [0.0, -1.0, 1e9, float("nan"), True, "2"])
def test_kernel_scale_out_of_bounds_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="kernel_scale must be a number in"):
        replace(CURVED, kernel_scale=value)


def test_calibrate_prices_the_kernel_probe_growing_with_its_batch() -> None:
    """The priced side of the kernel probe: gpt.py's model, more sequences, more kernel seconds;
    ``kernel_scale`` is the measured growth over that."""
    from simulator import calibrate
    from simulator.calibrate_host import KERNEL_BATCHES, kernel_scale

    small, large = KERNEL_BATCHES
    priced = {b: calibrate.priced_kernel_seconds(CURVED, b) for b in KERNEL_BATCHES}
    assert 0 < priced[small] < priced[large]
    measured = {small: 1.0 + 2 * priced[small], large: 1.0 + 2 * priced[large]}  # same host cost, 2x kernels
    assert kernel_scale(measured, priced) == pytest.approx(2.0)


def test_the_clips_ops_pay_the_optimizer_op_cost(tmp_path: Path) -> None:
    """Optimizer-phase ops (the global-norm clip's) run outside autograd: the profile's own host
    cost for them, not a forward or backward op's; an explicit ``op_overhead`` still prices all."""
    strategy = GPTStrategy(dp=2, grad_clip=1.0)
    step = trace_gpt_step(SHAPE, strategy, layers_traced=SHAPE.layers)
    cheap = replace(CURVED, optimizer_op_overhead_s=1e-5)
    costs, plain = PlanCosts(step.plan, cheap), PlanCosts(step.plan, CURVED)
    clip = [op for op in step.plan.ops if op.phase == "optimizer"]
    forward = [op for op in step.plan.ops if op.phase == "forward"]
    assert clip and forward
    for op in clip:
        assert plain.op_time(op, 0) - costs.op_time(op, 0) == pytest.approx(2e-4 - 1e-5, rel=1e-9)
        assert PlanCosts(step.plan, cheap, op_overhead=2e-4).op_time(op, 0) == pytest.approx(plain.op_time(op, 0))
    for op in forward:
        assert costs.op_time(op, 0) == plain.op_time(op, 0)
    # Every rank runs the same clip, so the step is shorter by its ops' difference on one rank.
    on_rank0 = sum(
        1
        for op, part in zip(step.plan.ops, step.op_parts, strict=True)
        if op.phase == "optimizer" and part != SETUP and 0 in costs.op_ranks(op)
    )
    faster = estimate(SHAPE, strategy, cheap, step=step).step_time_s
    assert faster == pytest.approx(estimate(SHAPE, strategy, CURVED, step=step).step_time_s - on_rank0 * (2e-4 - 1e-5))
    cheap.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").optimizer_op_overhead_s == 1e-5
    with pytest.raises(ValueError, match="optimizer_op_overhead_s"):
        replace(CURVED, optimizer_op_overhead_s=-1.0)


def test_a_gradient_reduction_costs_what_a_data_parallel_step_pays(tmp_path: Path) -> None:
    """With ``grad_sync_s`` (a dp=2 step over the one-rank one, per gradient reshard) each
    gradient reshard of backward costs that, whole; every other reshard and an explicit
    ``op_overhead`` price as before."""
    strategy = GPTStrategy(dp=2, tp=2)
    step = trace_gpt_step(SHAPE, strategy, layers_traced=SHAPE.layers)
    measured = replace(CURVED, grad_sync_s=1e-4)
    costs, plain = PlanCosts(step.plan, measured), PlanCosts(step.plan, CURVED)
    grads = [r for r in step.plan.reshards if r.index in step.grad_sync]
    others = [r for r in step.plan.reshards if r.index not in step.grad_sync]
    assert grads and others
    for r in grads:
        assert costs.reshard_times(r) == 1e-4
        assert all(costs.reshard_time(r, q) == 1e-4 for q in costs.reshard_ranks(r))
        assert PlanCosts(step.plan, measured, op_overhead=2e-4).reshard_times(r) == PlanCosts(
            step.plan, CURVED, op_overhead=2e-4
        ).reshard_times(r)
    for r in others:
        assert costs.reshard_times(r) == plain.reshard_times(r)
    measured.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json").grad_sync_s == 1e-4
    with pytest.raises(ValueError, match="grad_sync_s"):
        replace(CURVED, grad_sync_s=2.0)
