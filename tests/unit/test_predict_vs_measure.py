"""benchmarks/predict_vs_measure.py's pricing: kernels at the rate they run at in a training step.

The benchmark itself (calibration, mpiexec runs) is not run here; these check the pure parts:
the kernel probe's scale and that the prediction of the eager pipeline plan prices every
kernel (GEMMs and elementwise ops alike) at the scaled rate.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import predict_vs_measure as pvm

from simulator.cost import HardwareProfile, Link

FREE = Link(0.0, 1e30)


def _compute_only(gemm_flops: float = 4e10) -> HardwareProfile:
    """Links that cost nothing: a step's time is its kernels' alone."""
    return HardwareProfile("compute-only", FREE, FREE, {"float32": gemm_flops, "float64": gemm_flops / 2})


def test_kernel_scale_is_measured_growth_over_priced_growth() -> None:
    small, large = pvm.KERNEL_BATCHES
    # Host overhead (the 1.0 s both runs share) cancels: only the growth counts.
    assert pvm.kernel_scale({small: 1.0 + 0.2, large: 1.0 + 2.6}, {small: 0.1, large: 1.3}) == pytest.approx(2.0)
    assert pvm.kernel_scale({small: 0.5, large: 0.8}, {small: 0.1, large: 0.4}) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("measured", "priced", "words"),
    [
        ({2: math.nan, 16: 1.0}, {2: 0.1, 16: 0.5}, "measured seconds at micro-batch 2 is nan"),
        ({2: 0.5, 16: -1.0}, {2: 0.1, 16: 0.5}, "measured seconds at micro-batch 16 is -1.0"),
        ({2: 0.5}, {2: 0.1, 16: 0.5}, "measured seconds at micro-batch 16 is None"),
        ({2: 0.5, 16: 1.0}, {2: 0.1, 16: math.inf}, "priced seconds at micro-batch 16 is inf"),
        ({2: 0.5, 16: 1.0}, {2: 0.5, 16: 0.5}, "priced kernel seconds do not grow"),
        ({2: 0.9, 16: 0.8}, {2: 0.1, 16: 0.5}, "did not grow from micro-batch 2 to 16"),
    ],
)
def test_kernel_scale_refuses_a_bad_probe(measured: dict[int, float], priced: dict[int, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        pvm.kernel_scale(measured, priced)


def test_kernel_seconds_grow_with_the_probe_batch() -> None:
    """The probe's two batches run the same ops: the priced kernels grow about 8x (2 -> 16 sequences)."""
    prof = _compute_only()
    steps = {b: pvm.one_rank_step(b) for b in pvm.KERNEL_BATCHES}
    assert len(steps[2].plan.ops) == len(steps[16].plan.ops)
    k = {b: pvm.kernel_seconds(steps[b], prof, 1e9) for b in pvm.KERNEL_BATCHES}
    assert 7.0 < k[16] / k[2] <= 8.0 + 1e-9, k


def _predict(step: Any, scale: float) -> float:
    host = {"op": 0.0, "update": 0.0, "vector_flops": 1e9 / scale}
    return pvm.predict(step, pvm.loaded_profile(_compute_only(), 0.0, scale), host, 0.0, host["vector_flops"])


def test_the_pipeline_plan_prices_every_kernel_at_the_scaled_rate() -> None:
    """gpt.py's eager pp=4 plan (stages one after another): with free links and no host
    overhead the step is its kernels, so scaling the kernel rates by 1/k scales it by k exactly
    -- only if the GEMMs (the profile) and the elementwise ops (vector_flops) both follow."""
    step = pvm.gpt_step("dp=1,tp=2,pp=4")
    base = _predict(step, 1.0)
    assert base > 0
    assert _predict(step, 2.5) == pytest.approx(2.5 * base, rel=1e-9)
    # Scaling one of the two alone moves the step by less: both families carry real time.
    host = {"op": 0.0, "update": 0.0, "vector_flops": 1e9}
    gemm_only = pvm.predict(step, pvm.loaded_profile(_compute_only(), 0.0, 2.5), host, 0.0, host["vector_flops"])
    assert base < gemm_only < 2.5 * base - 1e-6 * base


def test_at_load_moves_every_gemm_rate_in_proportion() -> None:
    prof = _compute_only(4e10)
    now = pvm.at_load(prof, 1e10, 1e9)
    assert now.flops_per_s == pytest.approx({"float32": 1e10, "float64": 5e9})
    assert now.intra_node == prof.intra_node
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="float32 GEMM rate"):
            pvm.at_load(prof, bad, 1e9)


def _curved() -> HardwareProfile:
    """A calibrated-style profile: its best GEMM 4e10, the 512x512 one (the calibration's raw
    measurement) 2e10, GEMM and elementwise rates by size."""
    return replace(
        _compute_only(4e10),
        gemm_curve=((1e5, 0.25), (1e8, 1.0)),
        vector_curve=((1e4, 1e9), (1e6, 2e8)),
        calibration={"gemm": {"float32": {"n": 512, "flops_per_s": 2e10}}},
    )


def test_at_load_moves_the_curves_by_the_workers_rates_and_keeps_their_shape() -> None:
    prof = _curved()
    at_loop = prof.vector_rate(pvm.LOOP_BYTES)
    now = pvm.at_load(prof, 1e10, 0.5 * at_loop)  # the 512x512 GEMM and the loop both at half the calibration's
    assert now.flops_per_s["float32"] == pytest.approx(2e10)
    assert now.gemm_curve == prof.gemm_curve
    assert [r for _, r in now.vector_curve] == pytest.approx([5e8, 1e8])
    assert now.vector_rate(pvm.LOOP_BYTES) == pytest.approx(0.5 * at_loop)


def test_flat_is_the_512_gemm_rate_for_every_size() -> None:
    level = pvm.flat(_curved())
    assert level.flops_per_s == pytest.approx({"float32": 2e10, "float64": 1e10})
    assert level.gemm_curve == () and level.vector_curve == ()


def test_the_curves_price_small_and_large_kernels_apart() -> None:
    """The probe's micro-batch 2 and 16 models: under the curves (elementwise slower per FLOP on
    larger operands here) the large one's kernels cost more than 8x the small one's, under the
    flat model at most 8x: the size dependence the flat ``kern x`` could not express."""
    steps = {b: pvm.one_rank_step(b) for b in pvm.KERNEL_BATCHES}
    curved = {b: pvm.kernel_seconds(steps[b], _curved(), None) for b in pvm.KERNEL_BATCHES}
    flat = {b: pvm.kernel_seconds(steps[b], pvm.flat(_curved()), 1e9) for b in pvm.KERNEL_BATCHES}
    assert curved[16] / curved[2] > 8.5
    assert flat[16] / flat[2] <= 8.0 + 1e-9


def test_scale_by_size_is_each_batchs_kernel_time_over_its_priced_kernels() -> None:
    small, large = pvm.KERNEL_BATCHES
    # 1.0 s of the probe is host time (ops x op overhead): what is left is kernel time.
    got = pvm.scale_by_size({small: 1.0 + 0.15, large: 1.0 + 2.4}, {small: 0.1, large: 0.8}, {small: 1.0, large: 1.0})
    assert got == pytest.approx({small: 1.5, large: 3.0})


def test_scale_by_size_refuses_a_probe_with_no_kernel_time_left() -> None:
    small, large = pvm.KERNEL_BATCHES
    with pytest.raises(ValueError, match=r"micro-batch 2: measured 0\.9 s, of which host 1 s"):
        pvm.scale_by_size({small: 0.9, large: 3.0}, {small: 0.1, large: 0.8}, {small: 1.0, large: 1.0})


def test_sized_prices_each_kernel_at_its_own_sizes_scale() -> None:
    """At the small probe's typical sizes a kernel runs at the flat rate / x(2), at the large
    probe's at / x(16), in between on the log-size line, and beyond them level."""
    prof = pvm.flat(_curved())
    small, large = pvm.KERNEL_BATCHES
    anchors = {small: (1e6, 1e5), large: (8e6, 8e5)}
    model = pvm.sized(prof, 1e9, anchors, {small: 1.5, large: 3.0})
    rate = prof.flops_per_s["float32"]

    def gemm_rate(flops: float) -> float:
        return model.flops_per_s["float32"] * model.gemm_efficiency(flops)

    assert gemm_rate(1e6) == pytest.approx(rate / 1.5)
    assert gemm_rate(8e6) == pytest.approx(rate / 3.0)
    assert gemm_rate(1e3) == pytest.approx(rate / 1.5) and gemm_rate(1e9) == pytest.approx(rate / 3.0)
    assert rate / 3.0 < gemm_rate(math.sqrt(8) * 1e6) < rate / 1.5
    assert model.vector_rate(1e5) == pytest.approx(1e9 / 1.5) and model.vector_rate(8e5) == pytest.approx(1e9 / 3.0)


def test_probe_sizes_grow_with_the_probe_batch() -> None:
    """The large probe's typical GEMM and elementwise op are several times the small one's."""
    prof = _compute_only()
    sizes = {b: pvm.probe_sizes(pvm.one_rank_step(b), prof) for b in pvm.KERNEL_BATCHES}
    small, large = pvm.KERNEL_BATCHES
    for k in range(2):
        assert 2.0 < sizes[large][k] / sizes[small][k] <= 8.0 + 1e-9, sizes


def test_round_order_puts_every_run_in_every_position_once() -> None:
    names = ["host", "a", "b", "c"]
    orders = [pvm.round_order(names, r) for r in range(len(names))]
    assert orders[0] == names and orders[1] == ["a", "b", "c", "host"]
    for position in range(len(names)):
        assert sorted(o[position] for o in orders) == sorted(names)
    assert pvm.round_order(names, len(names)) == names
    assert pvm.round_order([], 3) == []


def test_interleaved_runs_each_name_once_per_round_in_rotated_order() -> None:
    calls: list[tuple[str, int]] = []

    def run(name: str, round_: int) -> str:
        calls.append((name, round_))
        return f"{name}{round_}"

    got = pvm.interleaved(["x", "y", "z"], 2, run)
    assert calls == [("x", 0), ("y", 0), ("z", 0), ("y", 1), ("z", 1), ("x", 1)]
    assert got == {"x": ["x0", "x1"], "y": ["y0", "y1"], "z": ["z0", "z1"]}
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        pvm.interleaved(["x"], 0, run)


def test_steady_is_the_median_of_each_constant_with_its_range() -> None:
    """One noisy worker run (a 4x collective) does not move the set every strategy is priced with."""
    rows = [
        {"op": 2e-4, "allreduce8_2": 1e-3},
        {"op": 3e-4, "allreduce8_2": 4e-3},
        {"op": 2.5e-4, "allreduce8_2": 1.2e-3},
    ]
    med, spread = pvm.steady(rows)
    assert med == pytest.approx({"op": 2.5e-4, "allreduce8_2": 1.2e-3})
    assert spread["allreduce8_2"] == pytest.approx((1e-3, 4e-3))
    assert spread["op"] == pytest.approx((2e-4, 3e-4))


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ([], "no worker measurements"),
        ([{"op": 1.0}, {"op": 1.0, "update": 2.0}], r"worker run 1: constants \['update'\] differ"),
        ([{"op": 1.0}, {"op": math.nan}], "worker run 1: op is nan"),
        ([{"op": -1.0}], "worker run 0: op is -1.0"),
        ([{"op": math.inf}], "worker run 0: op is inf"),
    ],
)
def test_steady_refuses_bad_worker_output(rows: list[dict[str, float]], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        pvm.steady(rows)


def test_round_spread_is_half_the_range() -> None:
    assert pvm.round_spread([0.5, 0.7, 0.6]) == pytest.approx(0.1)
    assert pvm.round_spread([0.5]) == 0.0


def test_predicted_breakdown_adds_up_to_the_prediction() -> None:
    """compute + host + comm is the estimate; each part is what its own costs add (links free:
    no comm; no host costs: no host part; compute is the kernels-only estimate)."""
    step = pvm.gpt_step("dp=2,tp=4")
    host = {"op": 2e-4, "update": 3e-5, "vector_flops": 5e8}
    slow = replace(_compute_only(), intra_node=Link(2e-4, 1e9), inter_node=Link(2e-4, 1e9))
    parts = pvm.predicted_breakdown(step, slow, host, 5e-4, host["vector_flops"])
    full = pvm.predict(step, slow, host, 5e-4, host["vector_flops"])
    assert sum(parts.values()) == pytest.approx(full)
    assert min(parts.values()) > 0, parts
    assert parts["compute"] == pytest.approx(
        pvm.predict(step, _compute_only(), {**host, "op": 0.0, "update": 0.0}, 0.0, 5e8)
    )
    free = pvm.predicted_breakdown(step, _compute_only(), host, 0.0, host["vector_flops"])
    assert free["comm"] == pytest.approx(0.0, abs=1e-12)
    assert free["host"] == pytest.approx(parts["host"])


def test_round_scales_is_each_worker_runs_own_kern_x() -> None:
    """A run whose probe grew twice as much (same rates) has twice the kern x."""
    prof = _curved()
    probes = {b: pvm.one_rank_step(b) for b in pvm.KERNEL_BATCHES}
    level = pvm.flat(pvm.at_load(prof, 2e10, 1e9))
    priced = {b: pvm.kernel_seconds(probes[b], level, 1e9) for b in pvm.KERNEL_BATCHES}
    small, large = pvm.KERNEL_BATCHES
    grow = priced[large] - priced[small]
    rows = [
        {"gemm_flops": 2e10, "vector_flops": 1e9, f"model_fb{small}": 0.1, f"model_fb{large}": 0.1 + k * grow}
        for k in (2.0, 4.0)
    ]
    assert pvm.round_scales(prof, probes, rows) == pytest.approx([2.0, 4.0])


def _host(cost: dict[int, float]) -> dict[str, float]:
    """Worker output whose all-reduce over ``n`` ranks costs ``cost[n]`` seconds after any gap."""
    return {f"allreduce{n}_{g}": c for n, c in cost.items() for g in range(len(pvm.GAP_GRID))}


def test_at_size_uses_a_measured_group_sizes_own_cost() -> None:
    host = _host({2: 1e-3, 4: 4e-3, 8: 5e-3})
    assert pvm.at_size(host, 4, 1e-3) == pytest.approx(4e-3)  # not the ring's line 2 -> 8 (2e-3)
    assert pvm.at_size(host, 3, 0.0) == pytest.approx(2.5e-3)
    assert pvm.at_size(host, 6, 0.0) == pytest.approx(4.5e-3)
    assert pvm.at_size(host, 16, 0.0) == pytest.approx(7e-3)  # the 4 -> 8 line beyond


def test_loaded_latency_prices_each_call_at_its_own_size_and_gap() -> None:
    host = _host({2: 1e-3, 4: 4e-3, 8: 5e-3})
    host.update({f"allreduce8_{g}": 5e-3 + 1e-3 * g for g in range(len(pvm.GAP_GRID))})
    # Only 8-rank all-reduces: each costs base + 14 alpha = its gap's measured cost, on average.
    calls = [pvm.Collective(pvm.GAP_GRID[0], ((8, 14),)), pvm.Collective(pvm.GAP_GRID[2], ((8, 14),))]
    alpha, base = pvm.loaded_latency(host, calls)
    assert base + 14 * alpha == pytest.approx((5e-3 + 7e-3) / 2)
    # Mixed sizes (tensor and data parallel): the calls together cost what the worker measured for each.
    mixed = [pvm.Collective(0.0, steps) for steps in (((2, 2),), ((4, 6),), ((4, 3), (2, 1)), ((8, 14),))]
    alpha, base = pvm.loaded_latency(host, mixed)
    priced = sum(base + alpha * sum(t for _, t in c.steps) for c in mixed)
    assert priced == pytest.approx(1e-3 + 4e-3 + (4e-3 + 1e-3) + 5e-3)
    assert alpha >= 0 and base >= 0


def _sized_host(cost: dict[int, float]) -> dict[str, float]:
    """Worker output whose all-reduce over 2 ranks of ``b`` bytes costs ``cost[b]`` after any gap."""
    return {pvm.allreduce_key(2, g, b): c for b, c in cost.items() for g in range(len(pvm.GAP_GRID))}


def test_at_gap_prices_a_message_by_its_size_between_the_measured_ones() -> None:
    small, mid, big = pvm.MESSAGE_BYTES
    host = _sized_host({small: 1e-3, mid: 2e-3, big: 4e-3})
    assert pvm.at_gap(host, 2, 1e-3) == pytest.approx(1e-3)  # the latency probe's own
    assert pvm.at_gap(host, 2, 1e-3, 100) == pytest.approx(1e-3)  # below 1 KiB: the 1 KiB cost
    assert pvm.at_gap(host, 2, 1e-3, (small + mid) / 2) == pytest.approx(1.5e-3)
    assert pvm.at_gap(host, 2, 1e-3, (mid + big) / 2) == pytest.approx(3e-3)
    assert pvm.at_gap(host, 2, 1e-3, 2 * big - mid) == pytest.approx(6e-3)  # the last two sizes' line
    # A larger message never costs less than the 1 KiB one, even where the line falls.
    falling = _sized_host({small: 1e-3, mid: 3e-3, big: 2e-3})
    assert pvm.at_gap(falling, 2, 0.0, 8 * big) == pytest.approx(1e-3)
    # A worker that timed 1 KiB only prices every size at it.
    only_small = _sized_host({small: 1e-3})
    assert pvm.at_gap(only_small, 2, 0.0, big) == pytest.approx(1e-3)
    # Over group sizes the size holds too (at_size interpolates in n at that size).
    for n in (4, 8):
        host.update(
            {
                pvm.allreduce_key(n, g, b): c * n / 2
                for b, c in ((small, 1e-3), (mid, 2e-3), (big, 4e-3))
                for g in range(len(pvm.GAP_GRID))
            }
        )
    assert pvm.at_size(host, 6, 0.0, big) == pytest.approx(12e-3)


def test_loaded_latency_leaves_the_bytes_to_the_profiles_bandwidth() -> None:
    """A call's measured cost at its size is base + alpha terms + its bytes at the profile's
    bandwidth (``byte_s``, which the estimate adds itself): the calls together cost what the
    worker measured, never that plus the bandwidth's share again."""
    small, mid, big = pvm.MESSAGE_BYTES
    host = _sized_host({small: 1e-3, mid: 2e-3, big: 4e-3})
    host.update(_host({8: 2e-3}))
    calls = [pvm.Collective(0.0, ((2, 2),), big, 0.5e-3), pvm.Collective(0.0, ((2, 2),), small, 0.0)]
    alpha, base = pvm.loaded_latency(host, calls)
    assert sum(base + 2 * alpha + c.byte_s for c in calls) == pytest.approx(4e-3 + 1e-3)
    assert pvm.call_prices(host, calls) == pytest.approx(5e-3)


def test_collectives_carry_each_calls_size_and_its_bandwidth_seconds() -> None:
    """The pipeline's tensor-parallel all-reduces carry a stage's activations (16 sequences x 64
    tokens x 128 float32 = 512 KiB); dp=8's gradient all-reduces carry each gradient, none above
    a 128 x 512 weight's 256 KiB; each call's bytes at the profile's bandwidth are its byte_s."""
    link = Link(0.0, 1e9)
    prof = replace(_compute_only(), intra_node=link, inter_node=link)
    host = {"op": 1e-4}
    pp = pvm.collectives(pvm.gpt_step("dp=1,tp=2,pp=4"), prof, host, 1e9)
    activations = 16 * pvm.SEQ * pvm.GPT_CONFIG["n_embd"] * 4
    assert max(c.nbytes for c in pp if c.steps == ((2, 2),)) == pytest.approx(activations)
    for c in pp:
        if c.steps == ((2, 2),):  # an all-reduce over 2: 2 (n-1)/n bytes over the link
            assert c.byte_s == pytest.approx(c.nbytes / 1e9)
    dp = pvm.collectives(pvm.gpt_step("dp=8"), prof, host, 1e9)
    assert max(c.nbytes for c in dp) == pytest.approx(128 * 512 * 4)
    assert all(c.byte_s == pytest.approx(2 * 7 / 8 * c.nbytes / 1e9) for c in dp)


def test_collectives_are_rank_0s_calls_with_their_group_sizes() -> None:
    """dp=2,tp=4: tensor-parallel calls over 4, gradients over 2 (dp) and over 8 (replicated
    parameters), every 8-rank one an all-reduce; the pipeline's over 2 (tp) and transfers."""
    prof = _compute_only()
    host = {"op": 1e-4}
    tp = pvm.collectives(pvm.gpt_step("dp=2,tp=4"), prof, host, 1e9)
    steps = [st for c in tp for st in c.steps]
    assert {n for n, _ in steps} == {2, 4, 8}
    assert all(t == 14 for n, t in steps if n == 8)
    assert all(c.gap >= 0 for c in tp) and any(c.gap > 0 for c in tp)
    pp = pvm.collectives(pvm.gpt_step("dp=1,tp=2,pp=4"), prof, host, 1e9)
    assert {st for c in pp for st in c.steps} == {(2, 1), (2, 2)}
    dp = pvm.collectives(pvm.gpt_step("dp=8"), prof, host, 1e9)
    assert {st for c in dp for st in c.steps} == {(8, 14)}


def test_paired_ratios_are_each_rounds_own_and_their_median() -> None:
    ratios, mid = pvm.paired_ratios([0.6, 0.9, 0.7], [0.5, 0.6, 0.7])
    assert ratios == pytest.approx([1.2, 1.5, 1.0]) and mid == pytest.approx(1.2)
    with pytest.raises(ValueError, match="2 predictions for 3 measured"):
        pvm.paired_ratios([0.6, 0.9], [0.5, 0.6, 0.7])
    with pytest.raises(ValueError, match=r"measured step of round 2 is 0\.0"):
        pvm.paired_ratios([0.6, 0.9], [0.5, 0.0])


def _probes() -> tuple[dict[int, Any], Any, Any]:
    """The kernel probe's two one-rank steps, the step probe's clipped-update step and its data-parallel step."""
    return ({b: pvm.one_rank_step(b) for b in pvm.KERNEL_BATCHES}, *pvm.step_probes())


def test_the_step_probe_is_no_checked_strategy() -> None:
    """opt x and comm x come from a probe unlike every checked strategy, so each strategy's
    optimizer phase and collectives are predicted, not measured: no strategy's rank updates
    what the probe's rank updates (its tensors and elements), and the probe makes fewer calls
    than dp=8, with less work before them (its gaps)."""
    prof = _compute_only()
    host = {"op": 2e-4, "update": 3e-5, **_host({2: 1e-3, 4: 2e-3, 8: 4e-3})}
    clip, dp = pvm.step_probes()
    assert clip.shape.layers == dp.shape.layers == pvm.PROBE_LAYERS != pvm.GPT_CONFIG["n_layer"]
    assert dp.strategy.dp == 8 and dp.shape.micro_batch_size == pvm.PROBE_BATCH

    def per_rank(step: Any) -> dict[int, tuple[int, int]]:
        """Each rank's (parameter tensors, elements) its optimizer phase updates."""
        out: dict[int, tuple[int, int]] = {}
        for part, ranks in step.update_elements.items():
            for r, n in ranks.items():
                t, e = out.get(r, (0, 0))
                out[r] = (t + step.update_counts[part], e + n)
        return out

    probe_rank = per_rank(clip)
    assert list(probe_rank) == [0] and probe_rank[0][0] > 0
    for mesh in pvm.DEFAULT_STRATEGIES.split(";"):
        step = pvm.gpt_step(mesh)
        assert step.shape.layers != pvm.PROBE_LAYERS
        assert probe_rank[0] not in per_rank(step).values(), mesh
    dp8 = pvm.gpt_step("dp=8")
    probe_calls = pvm.collectives(dp, prof, host, 5e8)
    dp8_calls = pvm.collectives(dp8, prof, host, 5e8)
    assert 0 < len(probe_calls) < len(dp8_calls)
    assert statistics.median(c.gap for c in probe_calls) < statistics.median(c.gap for c in dp8_calls)
    assert pvm.call_prices(host, probe_calls) < pvm.call_prices(host, dp8_calls)


def test_flat_predict_follows_the_worker_runs_constants() -> None:
    """One worker run's constants price the step: a run whose probe grew more (kernels slower in
    the training step), whose clipped update or whose data-parallel backward took longer
    predicts a longer step. The steady loop's all-reduce prices set only the shape over gaps
    and group sizes: all of them twice as high predicts the same step (their level is the
    data-parallel probe's)."""
    prof = _curved()
    probes, clip, dp = _probes()
    small, large = pvm.KERNEL_BATCHES
    host = {
        "op": 2e-4,
        "update": 3e-5,
        "vector_flops": 5e8,
        "gemm_flops": 2e10,
        f"model_fb{small}": 0.2,
        f"model_fb{large}": 1.0,
        "probe_fb": 0.1,
        "probe_update": 0.05,
        "dp_fb": 0.2,
        **_host({2: 1e-3, 4: 2e-3, 8: 4e-3}),
    }
    step = pvm.gpt_step("dp=2,tp=4")
    base = pvm.flat_predict(step, prof, probes, host, clip, dp)
    assert base > 0
    assert pvm.flat_predict(step, prof, probes, {**host, f"model_fb{large}": 1.4}, clip, dp) > base
    assert pvm.flat_predict(step, prof, probes, {**host, "probe_update": 0.08}, clip, dp) > base
    assert pvm.flat_predict(step, prof, probes, {**host, "dp_fb": 0.3}, clip, dp) > base
    doubled = pvm.flat_predict(step, prof, probes, {**host, **_host({2: 2e-3, 4: 4e-3, 8: 8e-3})}, clip, dp)
    assert doubled == pytest.approx(base, rel=1e-9)


def test_optimizer_seconds_is_what_opt_x_scales_in_the_prediction() -> None:
    """The optimizer phase as the estimate prices it: predicting with opt x 1.5 adds half of it;
    clipping adds its ops; each parameter's update adds host['update']."""
    prof = _compute_only()
    host = {"op": 2e-4, "update": 3e-5}
    step = pvm.gpt_step("dp=8")
    opt = pvm.optimizer_seconds(step, prof, host, 5e8)
    one = pvm.predict(step, prof, host, 0.0, 5e8)
    assert pvm.predict(step, prof, host, 0.0, 5e8, 1.5) == pytest.approx(one + 0.5 * opt, rel=1e-9)
    small = pvm.KERNEL_BATCHES[0]
    clipped, plain = pvm.one_rank_step(small, grad_clip=1.0), pvm.one_rank_step(small)
    assert pvm.optimizer_seconds(clipped, prof, host, 5e8) > pvm.optimizer_seconds(plain, prof, host, 5e8) > 0
    params = sum(plain.update_counts.values())
    more = pvm.optimizer_seconds(plain, prof, {**host, "update": 1e-4}, 5e8) - pvm.optimizer_seconds(
        plain, prof, host, 5e8
    )
    assert more == pytest.approx(params * 7e-5, rel=1e-9)
    # dp=8's ranks update what a 4-layer one-rank model updates (replicated parameters); the
    # step probe's 2 layers price lower: opt x is not taken from dp=8's own phase.
    assert opt == pytest.approx(pvm.optimizer_seconds(clipped, prof, host, 5e8), rel=1e-9)
    assert pvm.optimizer_seconds(pvm.step_probes()[0], prof, host, 5e8) < 0.7 * opt


@pytest.mark.parametrize(
    ("measured", "priced", "words"),
    [
        (0.0, 0.1, "measured seconds .* is 0.0"),
        (math.nan, 0.1, "measured seconds .* is nan"),
        (0.05, math.inf, "priced seconds .* is inf"),
        (0.05, -1.0, "priced seconds .* is -1.0"),
    ],
)
def test_optimizer_scale_refuses_a_bad_probe(measured: float, priced: float, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        pvm.optimizer_scale(measured, priced)
    assert pvm.optimizer_scale(0.06, 0.08) == pytest.approx(0.75)


def test_comm_scale_is_the_probes_collective_time_over_the_loops_prices() -> None:
    """comm x: the data-parallel step probe's extra time over the steady loop's prices of its own
    calls; those calls then cost exactly that extra, and dp=8's (more calls, longer gaps) more:
    a prediction, not the probe's measurement."""
    prof = _compute_only()
    host = {"op": 2e-4, "update": 3e-5, "probe_fb": 0.2, "dp_fb": 0.35, **_host({2: 1e-3, 4: 2e-3, 8: 4e-3})}
    host.update({f"allreduce8_{g}": 1e-3 * (1 + g) for g in range(len(pvm.GAP_GRID))})
    dp_calls = pvm.collectives(pvm.step_probes()[1], prof, host, 5e8)
    priced = pvm.call_prices(host, dp_calls)
    assert priced == pytest.approx(sum(pvm.at_gap(host, 8, c.gap) for c in dp_calls))
    factor = pvm.comm_scale(host, dp_calls)
    assert factor == pytest.approx(0.15 / priced)
    scaled = pvm.scaled_collectives(host, factor)
    assert scaled["op"] == host["op"] and scaled["probe_fb"] == host["probe_fb"]
    assert pvm.call_prices(scaled, dp_calls) == pytest.approx(0.15, rel=1e-9)
    step_calls = pvm.collectives(pvm.gpt_step("dp=8"), prof, host, 5e8)
    assert pvm.call_prices(scaled, step_calls) > 1.2 * 0.15
    with pytest.raises(ValueError, match="is not above the one-rank"):
        pvm.comm_scale({**host, "dp_fb": 0.2}, dp_calls)
    with pytest.raises(ValueError, match="dp_fb is None"):
        pvm.comm_scale({k: v for k, v in host.items() if k != "dp_fb"}, dp_calls)
    with pytest.raises(ValueError, match="comm x must be"):
        pvm.scaled_collectives(host, 0.0)


def test_the_comm_term_is_what_the_worker_measured_the_calls_to_cost() -> None:
    """dp=8's comm term is its calls' prices (all-reduces over 8 at their gaps), whatever
    latency the profile's calibration holds: the loaded latency replaces it, never adds to it."""
    slow_link = Link(1e-3, 1e30)  # calibrate's alpha, measured under load: above the worker's per-term share
    prof = replace(_compute_only(), intra_node=slow_link, inter_node=slow_link)
    host = {"op": 2e-4, "update": 3e-5, **_host({2: 1e-3, 4: 2e-3, 8: 2e-3})}
    step = pvm.gpt_step("dp=8")
    calls = pvm.collectives(step, pvm.loaded_profile(prof, 0.0), host, 5e8)
    alpha, base = pvm.loaded_latency(host, calls)
    assert alpha < 1e-3
    parts = pvm.predicted_breakdown(step, pvm.loaded_profile(prof, alpha), host, base, 5e8)
    # (within 1%: the estimate also charges the per-call base to a reshard with no collective
    # step of rank 0's; the profile's 1 ms latency would add 14 ms per call, 7x the price)
    assert parts["comm"] == pytest.approx(pvm.call_prices(host, calls), rel=0.01)
    with pytest.raises(ValueError, match="loaded link latency"):
        pvm.loaded_profile(prof, -1e-6)


def test_step_scales_price_the_probes_with_the_models_own_rates() -> None:
    """opt x is the probe's measured update over its price under the model; a model with slower
    elementwise kernels prices the update higher and gets a smaller opt x."""
    prof = _compute_only()
    _, clip, dp = _probes()
    host = {
        "op": 2e-4,
        "update": 3e-5,
        "probe_fb": 0.2,
        "dp_fb": 0.35,
        "probe_update": 0.05,
        **_host({2: 1e-3, 4: 2e-3, 8: 4e-3}),
    }
    opt_x, comm_x = pvm.step_scales(host, prof, 5e8, clip, dp)
    assert opt_x == pytest.approx(0.05 / pvm.optimizer_seconds(clip, prof, host, 5e8))
    assert comm_x == pytest.approx(0.15 / pvm.call_prices(host, pvm.collectives(dp, prof, host, 5e8)))
    assert pvm.step_scales(host, prof, 2.5e8, clip, dp)[0] < opt_x


def test_collective_sequence_prices_each_call_at_its_gap() -> None:
    """benchmarks/collective_sequence.py charges a replayed call sequence what the benchmark
    charges it: the steady curve at each call's own gap (linear between grid points, the last
    point's beyond), summed; a curve of the wrong length is refused."""
    import collective_sequence as cs

    curve = [1e-3, 2e-3, 4e-3, 6e-3, 9e-3]  # at GAP_GRID = 0, 0.3, 1, 3, 10 ms
    gaps = [0.0, 3e-4, 6.5e-4, 2e-3, 0.05]
    expected = 1e-3 + 2e-3 + 3e-3 + 5e-3 + 9e-3
    assert cs.priced(curve, gaps) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="curve has 4 points"):
        cs.priced(curve[:4], gaps)


def test_collective_sequence_gaps_of_dp8(tmp_path: Path) -> None:
    """dp=8's rank-0 sequence: every call after some work, one long stretch (forward and the
    start of backward) before the first and short gaps after; more host time per op only
    lengthens the gaps."""
    import collective_sequence as cs

    path = tmp_path / "profile.json"
    _compute_only().save(str(path))
    short, long_ = cs.sequence_gaps(str(path), "dp=8", 1e-4), cs.sequence_gaps(str(path), "dp=8", 3e-4)
    assert len(short) == len(long_) >= 50
    assert short[0] > 10 * max(short[1:])
    assert all(b >= a for a, b in zip(short, long_, strict=True)) and sum(long_) > sum(short)
    with pytest.raises(ValueError, match="--op-us"):
        cs.sequence_gaps(str(path), "dp=8", -1.0)
