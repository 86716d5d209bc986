"""The cost model: collective formulas against hand-derived values, profiles, pipeline costs.

.venv/bin/python -m pytest tests/unit/test_cost.py -q
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpipar.comm import CommEvent
from mpipar.pipeline import build_schedule
from simulator import simulate_schedule
from simulator.calibrate import fit_alpha_beta, fit_reduction
from simulator.cost import (
    HardwareProfile,
    Link,
    PipelineCost,
    StageMemory,
    collective_time,
    list_presets,
    load_profile,
)

# alpha = 1 us, 1 GB/s: beta = 1 ns per byte.
LINK = Link(1e-6, 1e9)


@pytest.mark.parametrize(
    ("op", "nbytes", "n", "gamma_bps", "expected"),
    [
        # send: alpha + S beta = 1e-6 + 1e6 * 1e-9
        ("send", 1e6, 2, None, 1e-6 + 1e-3),
        # ring all-reduce, 4 ranks, 4 MB: 2*3 alpha + 2*(3/4)*4e6 beta = 6e-6 + 6e-3
        ("all_reduce", 4e6, 4, None, 6e-6 + 6e-3),
        # ... plus the reduction (3/4)*4e6 bytes at 2 GB/s = 1.5e-3
        ("all_reduce", 4e6, 4, 2e9, 6e-6 + 6e-3 + 1.5e-3),
        # reduce-scatter: 3 alpha + (3/4)*4e6 beta (+ (3/4)*4e6 / 2e9)
        ("reduce_scatter", 4e6, 4, None, 3e-6 + 3e-3),
        ("reduce_scatter", 4e6, 4, 2e9, 3e-6 + 3e-3 + 1.5e-3),
        # all-gather of an 8 MB output over 8 ranks: 7 alpha + (7/8)*8e6 beta; no reduction term
        ("all_gather", 8e6, 8, 2e9, 7e-6 + 7e-3),
        ("all_to_all", 8e6, 8, None, 7e-6 + 7e-3),
        # broadcast of 8 bytes on 8 ranks: tree 3*(1e-6 + 8e-9) beats (3+7)*1e-6 + 2*(7/8)*8e-9
        ("broadcast", 8, 8, None, 3 * (1e-6 + 8e-9)),
        # broadcast of 1 GB: scatter+all-gather (10e-6 + 1.75 s) beats the tree (3*(1e-6 + 1 s))
        ("broadcast", 1e9, 8, None, 10e-6 + 1.75),
        # reduce = broadcast's time + (7/8)*1e9 bytes at 2 GB/s
        ("reduce", 1e9, 8, 2e9, 10e-6 + 1.75 + 0.4375),
        # a group of one costs nothing
        ("all_reduce", 4e6, 1, 2e9, 0.0),
    ],
)
def test_collective_formulas(op: str, nbytes: float, n: int, gamma_bps: float | None, expected: float) -> None:
    assert collective_time(op, nbytes, n, LINK, gamma_bps) == pytest.approx(expected, rel=1e-12)


@given(n=st.integers(2, 64), nbytes=st.floats(0, 1e10), alpha=st.floats(0, 1e-3), bw=st.floats(1e6, 1e12))
def test_all_reduce_is_reduce_scatter_plus_all_gather(n: int, nbytes: float, alpha: float, bw: float) -> None:
    """The ring all-reduce is a reduce-scatter followed by an all-gather, in every term."""
    link = Link(alpha, bw)
    parts = collective_time("reduce_scatter", nbytes, n, link, 3e9) + collective_time(
        "all_gather", nbytes, n, link, 3e9
    )
    assert collective_time("all_reduce", nbytes, n, link, 3e9) == pytest.approx(parts, rel=1e-12, abs=1e-18)


def test_formula_errors() -> None:
    with pytest.raises(ValueError, match="collective 'gossip' has no cost formula; known: send, all_reduce"):
        collective_time("gossip", 8, 2, LINK)
    with pytest.raises(ValueError, match="group size must be a positive int, got 0"):
        collective_time("all_reduce", 8, 0, LINK)
    with pytest.raises(ValueError, match="nbytes must be a number >= 0, got -1"):
        collective_time("all_reduce", -1, 2, LINK)
    with pytest.raises(ValueError, match="bandwidth_Bps must be > 0 bytes/s, got 0"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match=r"alpha_s .* must be >= 0, got -1"):
        Link(-1, 1e9)


def test_h100_preset_link_classes() -> None:
    h100 = load_profile("h100-nvlink-ib")
    gib = 2**30
    # 8 GPUs of one node ride NVLink: 14 * 3 us + 1.75 GiB / 360 GB/s.
    assert h100.collective_time("all_reduce", gib, range(8)) == pytest.approx(14 * 3e-6 + 1.75 * gib / 360e9, rel=1e-12)
    # One GPU on each of two nodes: InfiniBand, 2 * 8 us + 1 GiB / 45 GB/s.
    assert h100.collective_time("all_reduce", gib, [0, 8]) == pytest.approx(2 * 8e-6 + gib / 45e9, rel=1e-12)
    assert h100.p2p_time(1e6, 3, 5) == pytest.approx(3e-6 + 1e6 / 360e9)
    assert h100.p2p_time(1e6, 7, 8) == pytest.approx(8e-6 + 1e6 / 45e9)
    assert h100.p2p_time(1e6, 4, 4) == 0.0
    # 1 TFLOP of bfloat16 at half of 989 TFLOP/s.
    assert h100.compute_time(1e12, "bfloat16") == pytest.approx(1e12 / (989e12 * 0.5))
    assert h100.compute_time(1e12, np.float32) == pytest.approx(1e12 / (67e12 * 0.5))
    with pytest.raises(ValueError, match="has no FLOP rate for dtype 'int8'; it knows \\['bfloat16'"):
        h100.compute_time(1, "int8")
    assert h100.memory_bytes == 81559 * 2**20


def test_comm_event_time_uses_the_right_buffer() -> None:
    prof = load_profile("cpu-local")
    gather = CommEvent("all_gather", (0, 1, 2, 3), input_nbytes=100, output_nbytes=400, dtype="float64")
    assert prof.comm_event_time(gather) == prof.collective_time("all_gather", 400, [0, 1, 2, 3])
    reduce = CommEvent("all_reduce", (0, 1), input_nbytes=800, output_nbytes=800, dtype="float64")
    assert prof.comm_event_time(reduce) == pytest.approx(2e-6 + 800 / 5e9 + 400 / 5e9)
    send = CommEvent("send", (2, 5), input_nbytes=64, output_nbytes=64, dtype="float64")
    assert prof.comm_event_time(send) == pytest.approx(1e-6 + 64 / 5e9)


def test_presets_and_profile_round_trip(tmp_path: Path) -> None:
    assert {"h100-nvlink-ib", "a100-nvlink-ib", "cpu-local"} <= set(list_presets())
    for name in list_presets():
        profile = load_profile(name)
        assert profile.name == name
        path = tmp_path / f"{name}.json"
        profile.save(path)
        assert HardwareProfile.load(path) == profile
        assert load_profile(str(path)) == profile
    with pytest.raises(ValueError, match="no hardware profile 'tpu-v9': not a file and not a preset; presets are a100"):
        load_profile("tpu-v9")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("format", "mpipar.timeline", "field format is 'mpipar.timeline', expected 'mpipar.hardware'"),
        ("version", 7, "field version is 7"),
        ("links", {"intra_node": {"alpha_s": 1e-6}}, "field links.intra_node is {'alpha_s': 1e-06}"),
        ("flops_per_s", {"float32": 0}, "flops_per_s\\['float32'\\] must be > 0, got 0"),
        ("devices_per_node", 0, "devices_per_node must be a positive int or None, got 0"),
        ("compute_efficiency", 1.5, "compute_efficiency must be in \\(0, 1\\], got 1.5"),
        ("reduction_Bps", -2.0, "reduction_Bps must be > 0 or None, got -2.0"),
        ("color", "red", "field 'color' is not a profile field"),
    ],
)
def test_malformed_profile_names_the_field(field: str, value: object, message: str) -> None:
    data = load_profile("h100-nvlink-ib").to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=message):
        HardwareProfile.from_dict(data, source="p.json")


def test_link_bandwidth_error_names_the_link() -> None:
    data = load_profile("cpu-local").to_dict()
    data["links"]["inter_node"]["bandwidth_Bps"] = -5
    with pytest.raises(ValueError, match=r"field links\.inter_node: Link bandwidth_Bps must be > 0 bytes/s, got -5"):
        HardwareProfile.from_dict(json.loads(json.dumps(data)))


# ---------------------------------------------------------------------- calibration fits
def test_fit_alpha_beta_recovers_exact_parameters() -> None:
    sizes = [8, 1024, 16384, 131072, 1 << 20, 4 << 20]
    times = [2e-6 + s / 7e9 for s in sizes]
    link = fit_alpha_beta(sizes, times)
    assert link.alpha_s == pytest.approx(2e-6, rel=1e-9)
    assert link.bandwidth_Bps == pytest.approx(7e9, rel=1e-9)
    # A ring all-reduce on 4 ranks, fitted with its formula's coefficients.
    ring = [collective_time("all_reduce", s, 4, Link(3e-6, 2e9)) for s in sizes]
    fitted = fit_alpha_beta(sizes, ring, steps=6, volume=1.5)
    assert (fitted.alpha_s, fitted.bandwidth_Bps) == (pytest.approx(3e-6, rel=1e-9), pytest.approx(2e9, rel=1e-9))
    with pytest.raises(ValueError, match="needs >= 2 positive timings"):
        fit_alpha_beta([8], [1e-6])


def test_fit_alpha_beta_survives_noise() -> None:
    """Timings from a loaded machine (an 8-byte all-reduce slower than a 16 KiB one) still fit."""
    sizes, times = [8, 16384, 1 << 20], [3.87e-05, 1.11e-05, 4.76e-3]
    link = fit_alpha_beta(sizes, times, steps=2, volume=1)
    assert link.alpha_s >= 0
    # The slope still follows the large message: 1 MiB in 4.76 ms is about 0.22 GB/s .. 1.3 GB/s.
    assert 1e8 < link.bandwidth_Bps < 2e9
    with pytest.raises(ValueError, match="timings do not grow with message size"):
        fit_alpha_beta([8, 1 << 20], [1e-3, 1e-3])


def test_fit_reduction_recovers_gamma() -> None:
    sizes = [8, 16384, 1 << 20, 4 << 20]
    link = Link(2e-6, 8e9)
    times = [collective_time("all_reduce", s, 2, link, 5e9) for s in sizes]
    assert fit_reduction(sizes, times, 2, link) == pytest.approx(5e9, rel=1e-9)
    no_extra = [collective_time("all_reduce", s, 2, link) for s in sizes]
    slower = [t * 0.9 for t in no_extra]
    assert fit_reduction(sizes, slower, 2, link) is None


# ---------------------------------------------------------------------- pipeline costs
def test_pipeline_cost_from_profile_and_simulation_by_hand() -> None:
    """FThenB, 2 stages on two nodes, 1 micro-batch: F0, send, F1, B1, send, B0 back to back."""
    prof = load_profile("h100-nvlink-ib")
    cost = PipelineCost.from_profile(
        prof, num_stages=2, forward_flops=[2e12, 4e12], message_bytes=1e8, dtype="bfloat16", rank_devices=[0, 8]
    )
    rate = 989e12 * 0.5
    assert cost.forward == pytest.approx((2e12 / rate, 4e12 / rate))
    assert cost.backward_input == cost.forward and cost.backward_weight == cost.forward
    hop = 8e-6 + 1e8 / 45e9  # devices 0 and 8 sit on different nodes
    assert cost.send_forward == pytest.approx((hop,)) and cost.send_backward == pytest.approx((hop,))
    timeline = simulate_schedule(build_schedule("FThenB", 2, 1), cost)
    f0, f1 = 2e12 / rate, 4e12 / rate
    assert timeline.makespan == pytest.approx(f0 + hop + f1 + 2 * f1 + hop + 2 * f0, rel=1e-12)
    assert timeline.time_unit == "s"
    comm = timeline.lane(1, "comm")
    assert [s.name for s in comm] == ["1RECV_F0", "1SEND_B0"]
    assert comm[0].duration == pytest.approx(hop)
    assert comm[0].start == pytest.approx(f0)
    # Same node: NVLink instead.
    near = PipelineCost.from_profile(prof, num_stages=2, forward_flops=1e12, message_bytes=1e8, dtype="bfloat16")
    assert near.send_forward == pytest.approx((3e-6 + 1e8 / 360e9,))


def test_pipeline_cost_validation() -> None:
    with pytest.raises(ValueError, match="PipelineCost send_forward needs 3 values, got 2"):
        PipelineCost((1.0,) * 4, (1.0,) * 4, (1.0,) * 4, (0.0, 0.0), (0.0,) * 3)
    with pytest.raises(ValueError, match=r"PipelineCost forward\[1\] must be a finite number >= 0, got nan"):
        PipelineCost.uniform(2, forward=[1.0, math.nan])
    with pytest.raises(ValueError, match="rank_devices has 3 entries for 2 ranks"):
        PipelineCost.from_profile(
            load_profile("cpu-local"), num_stages=2, forward_flops=1, message_bytes=1, rank_devices=[0, 1, 2]
        )
    with pytest.raises(ValueError, match="the cost describes 3 stages but the schedule has 4"):
        simulate_schedule(build_schedule("1F1B", 4, 4), PipelineCost.uniform(3))
    with pytest.raises(ValueError, match="cost 'fast' is unknown"):
        simulate_schedule(build_schedule("1F1B", 4, 4), "fast")
    with pytest.raises(TypeError, match=r"needs an mpipar\.pipeline\.Schedule"):
        simulate_schedule([["0F0"]])  # type: ignore[arg-type]


def test_communication_cost_stretches_the_pipeline() -> None:
    """1F1B with transfers of c: every hop on the critical path adds c."""
    p, m, c = 4, 8, 0.5
    free = simulate_schedule(build_schedule("1F1B", p, m))
    slow = simulate_schedule(build_schedule("1F1B", p, m), PipelineCost.uniform(p, comm=c))
    assert slow.makespan > free.makespan
    # The fill and the drain each cross p-1 boundaries: at least 2(p-1)c more.
    assert slow.makespan >= free.makespan + 2 * (p - 1) * c
    for rank in range(p):
        assert slow.busy(rank) == free.busy(rank)
        for s in slow.lane(rank, "comm"):
            assert s.duration == c


def test_interleaved_memory_counts_every_chunk() -> None:
    memory = StageMemory.uniform(8, parameters=10.0, gradients=10.0, optimizer_state=20.0, activations=1.0)
    schedule = build_schedule("Interleaved1F1B", 8, 8, num_chunks=2)
    timeline = simulate_schedule(schedule, PipelineCost.uniform(8, memory=memory))
    assert timeline.memory is not None
    for rank in range(4):
        curve = timeline.memory[rank]
        assert set(curve.bytes["parameters"]) == {20.0}  # two chunks of 10
        assert set(curve.bytes["optimizer_state"]) == {40.0}
        in_flight = schedule.peak_in_flight()
        assert max(curve.bytes["activations"]) <= in_flight[rank] + in_flight[rank + 4]
        assert curve.bytes["activations"][-1] == 0.0
