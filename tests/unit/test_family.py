"""The GPT/Llama family's closed-form counts against hand-computed ones, and the pipeline's closed form
against the schedule simulator."""

from __future__ import annotations

import dataclasses

import pytest

from simulator.cost import HardwareProfile, PipelineCost, collective_time, load_profile
from simulator.family import PRESETS, ModelShape, preset, stage_layer_counts, stage_of_layers
from simulator.family_cost import (
    OPTIMIZER_STREAM_BYTES,
    FamilyStrategy,
    activation_bytes,
    hardware_flops_per_token,
    interleaved_peak,
    layer_costs,
    layer_messages,
    layer_parameters_local,
    memory,
    price,
    schedule_times,
)
from simulator.fast_estimate import pipeline
from simulator.fast_pipeline import lane_flight_events, peak_in_flight
from simulator.step_trace import GPTShape

# (layers, hidden, heads, kv heads, ffn) of the Llama 3 model cards; vocabulary 128,256, untied.
LLAMA3 = {
    "llama3-8b": (32, 4096, 32, 8, 14336),
    "llama3-70b": (80, 8192, 64, 8, 28672),
    "llama3-405b": (126, 16384, 128, 8, 53248),
}
PUBLISHED_PARAMETERS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_llama3_parameters_by_hand(name: str) -> None:
    layers, h, heads, kv, f = LLAMA3[name]
    v = 128256
    kv_width = h // heads * kv
    attention = h * h + 2 * h * kv_width + h * h  # q, k, v, o: no biases
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h  # two RMSNorm scales
    by_hand = layers * (attention + mlp + norms) + v * h + h + v * h  # embedding, final norm, untied output
    shape = preset(name)
    assert shape.parameters == by_hand == PUBLISHED_PARAMETERS[name]


def test_gpt_parameters_match_the_traced_model_when_untied() -> None:
    """LayerNorm/GELU shapes are mpipar's GPT (biases, learned positions): untied, the count is
    ``GPTShape.parameters``; tied, the output matrix and its bias are gone."""
    gpt = GPTShape(6, 96, 4, 64, 500)
    untied = ModelShape(6, 96, 4, 64, 500, untied=True)
    assert untied.parameters == gpt.parameters
    assert ModelShape(6, 96, 4, 64, 500).parameters == gpt.parameters - 500 * 96 - 500


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_llama3_model_flops_per_token_by_hand(name: str) -> None:
    layers, h, heads, kv, f = LLAMA3[name]
    s, v = 8192, 128256
    matrices = 2 * h * h + 2 * h * (h // heads * kv) + 3 * h * f
    forward = layers * (2 * matrices + 4 * s * h) + 2 * v * h  # GEMMs, scores and weighted sum, output layer
    assert preset(name).model_flops_per_token == 3 * forward


def test_gpt_model_flops_are_narayanan_eq3() -> None:
    """Narayanan et al. 2021 Eq. 3 per token with 72 (no recompute): 72 l h^2 (1 + s/6h + V/12lh)."""
    n, h, s, v = 96, 12288, 2048, 51200
    shape = ModelShape(n, h, 96, s, v)
    assert shape.model_flops_per_token == pytest.approx(
        72 * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)), rel=1e-12
    )


def test_hardware_flops_fused_attention_and_recompute() -> None:
    """Fused causal attention does half the scores' work and recomputes them in backward (2.5
    forwards); plain does all of it, three passes; full recompute adds one forward."""
    shape = preset("llama3-8b")
    h, s, layers = 4096, 8192, 32
    mats = 2 * shape.layer_matrix_weights
    core = 4.0 * s * h
    none = FamilyStrategy()
    fused = layers * (3 * mats + core / 2 * 3.5) + 6 * 128256 * h
    assert hardware_flops_per_token(shape, none) == pytest.approx(fused, rel=1e-12)
    plain = dataclasses.replace(shape, attention="plain")
    assert hardware_flops_per_token(plain, none) == pytest.approx(shape.model_flops_per_token, rel=1e-12)
    full = FamilyStrategy(recompute="full")
    assert hardware_flops_per_token(shape, full) - hardware_flops_per_token(shape, none) == pytest.approx(
        layers * (mats + core / 2), rel=1e-12
    )


def test_activation_bytes_korthikanti_table2() -> None:
    """GPT with tensor and sequence parallelism, no recompute: ``s b h (34 + 5 a s / h) / t``;
    selective recompute drops the ``5 a s / h``; full keeps the layer's input, ``2 s b h / t``."""
    s, b, h, a, t = 2048, 2, 6144, 64, 8
    shape = ModelShape(48, h, a, s, 51200, micro_batch_size=b)
    sp = FamilyStrategy(tp=t, sequence_parallel=True)
    assert activation_bytes(shape, sp) == (34 * s * b * h + 5 * a * s * s * b) // t
    assert activation_bytes(shape, dataclasses.replace(sp, recompute="selective")) == s * b * h * 34 // t
    assert activation_bytes(shape, dataclasses.replace(sp, recompute="full")) == 2 * s * b * h // t
    # Without sequence parallelism the 10 sbh of norms, GEMM inputs and masks stay whole.
    assert activation_bytes(shape, FamilyStrategy(tp=t)) == 10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // t


def test_activation_bytes_llama3_405b_by_hand() -> None:
    """405B, tp 8 with sequence parallelism, fused attention, no dropout, one 8k sequence."""
    shape = preset("llama3-405b")
    st = FamilyStrategy(tp=8, sequence_parallel=True)
    tokens, h = 8192, 16384
    q = h // 8  # 16 of 128 query heads
    kv = 128  # one of 8 key/value heads per rank
    f = 53248 // 8
    per_token = 2 * (q + 2 * kv) + 2 * q + 2 * (2 * f + f) + 4 * 16  # q k v, o's input, gate/up + product, lse
    seq_split = (2 * h + 2 * h + 2 * h + 2 * h) * tokens // 8  # two norms' inputs, two GEMM inputs
    assert activation_bytes(shape, st) == per_token * tokens + seq_split == 533_200_896
    # Context parallelism splits every token-proportional term.
    cp = dataclasses.replace(st, cp=4)
    assert activation_bytes(shape, cp) == 533_200_896 // 4


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_llama3_activation_bytes_per_layer_by_hand(name: str) -> None:
    """Any preset at tp 8 with sequence parallelism, cp 2, two sequences per micro-batch."""
    _layers, h, heads, kv, f = LLAMA3[name]
    shape = preset(name).sized(2)
    st = FamilyStrategy(tp=8, cp=2, sequence_parallel=True)
    tokens = 2 * 8192 // 2
    q, kv_width, ff = h // 8, 128 * max(kv // 8, 1), f // 8
    per_token = 2 * (q + 2 * kv_width) + 2 * q + 2 * 3 * ff + 4 * (heads // 8)
    assert activation_bytes(shape, st) == per_token * tokens + 8 * h * tokens // 8


@pytest.mark.parametrize("name", sorted(LLAMA3))
def test_llama3_collective_bytes_by_hand(name: str) -> None:
    """What one layer's collectives move per micro-batch at tp 4, cp 4: the 16-bit activation of
    the rank's tokens (tensor parallel), the keys and values of the whole sequence (context
    parallel: 2 of 8 key/value heads per rank), one layer's parameter shard (ZeRO)."""
    _layers, h, _heads, kv, f = LLAMA3[name]
    shape = preset(name)
    messages = layer_messages(shape, FamilyStrategy(tp=4, cp=4))
    assert messages["tp"] == 2 * (8192 // 4) * h
    assert messages["cp"] == 2 * 2 * 8192 * (kv // 4) * 128
    assert messages["zero"] == 2 * (2 * h * h // 4 + 2 * h * (kv // 4) * 128 + 3 * h * f // 4 + 2 * h)


def test_gqa_replicates_key_value_heads_beyond_their_count() -> None:
    shape = preset("llama3-70b")  # 8 key/value heads of 128
    h, f = 8192, 28672
    for tp, kv_heads in ((8, 1), (16, 1), (4, 2)):
        mats = 2 * h * (h // tp) + 2 * h * (kv_heads * 128) + 3 * h * (f // tp)
        assert layer_parameters_local(shape, tp) == mats + 2 * h
    with pytest.raises(ValueError, match="key/value heads must divide"):
        price(ModelShape(2, 768, 12, kv_heads=4), FamilyStrategy(tp=6), load_profile("h100-sxm"))


def test_stage_layer_counts_lighter_ends() -> None:
    assert stage_layer_counts(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B
    assert stage_layer_counts(96, 8) == [12] * 8
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]
    assert stage_layer_counts(11, 4) == [2, 3, 3, 3]
    assert stage_layer_counts(126, 16, 4) == [1] + [2] * 62 + [1]
    # Llama 3's one-layer chunks: the first chunk holds only the embedding, the last only the
    # output layer and loss; a stage between them always holds a layer.
    assert stage_layer_counts(126, 16, 8) == [0] + [1] * 126 + [0]
    assert stage_layer_counts(3, 4) == [0, 1, 1, 1]
    assert stage_layer_counts(2, 4) == [0, 1, 1, 0]
    assert stage_of_layers(10, 4) == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layer_counts(1, 4)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layer_counts(125, 16, 8)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        stage_layer_counts(8, 0)


@pytest.mark.parametrize(
    ("pp", "chunks", "m"), [(4, 1, 8), (4, 1, 3), (4, 2, 8), (2, 2, 6), (4, 4, 12), (8, 4, 16), (16, 8, 32)]
)
def test_schedule_closed_form_equals_the_simulator_on_even_stages(pp: int, chunks: int, m: int) -> None:
    st = FamilyStrategy(pp=pp, chunks=chunks, micro_batches=m, schedule="Interleaved1F1B" if chunks > 1 else "1F1B")
    n = pp * chunks
    f, b = 1.0 / chunks, 2.0 / chunks
    act = tuple([5] * n)
    closed = schedule_times(st, [f] * n, [b] * n, [0.0] * (n - 1), act)
    sim, _ = pipeline(
        st.pipeline_strategy(), PipelineCost((f,) * n, (b,) * n, (0.0,) * n, (0.0,) * (n - 1), (0.0,) * (n - 1)), act
    )
    assert closed.makespan == pytest.approx(sim.makespan, rel=1e-9)
    assert closed.in_flight == sim.in_flight


@pytest.mark.parametrize(("pp", "chunks", "m"), [(4, 2, 8), (2, 2, 6), (4, 4, 12), (8, 4, 16), (16, 8, 32)])
def test_interleaved_closed_form_counts_a_send_per_virtual_stage_boundary(pp: int, chunks: int, m: int) -> None:
    """The first micro-batch crosses all ``pp x chunks - 1`` boundaries forward (chunk ``c`` on
    the last rank sends to chunk ``c + 1`` on the first) and its gradient all of them back: the
    simulator's makespan grows by exactly ``2 (pp chunks - 1)`` sends, not ``2 (pp - 1)``, while
    a send is short of the schedule's slack (here 0.13% of a chunk's work)."""
    st = FamilyStrategy(pp=pp, chunks=chunks, micro_batches=m, schedule="Interleaved1F1B")
    n = pp * chunks
    f, b, send = 1.0 / chunks, 2.0 / chunks, 0.0005 / chunks
    act = tuple([5] * n)
    closed = schedule_times(st, [f] * n, [b] * n, [send] * (n - 1), act)
    sim, _ = pipeline(
        st.pipeline_strategy(), PipelineCost((f,) * n, (b,) * n, (0.0,) * n, (send,) * (n - 1), (send,) * (n - 1)), act
    )
    assert closed.makespan == pytest.approx(sim.makespan, rel=1e-9)
    assert closed.makespan == pytest.approx(m * 3.0 + (pp - 1) * 3.0 / chunks + 2 * (n - 1) * send, rel=1e-9)


def test_price_llama3_8b_is_consistent() -> None:
    hw = load_profile("h100-sxm")
    shape = preset("llama3-8b")
    st = FamilyStrategy(dp=8, tp=4, pp=2, cp=2, sequence_parallel=True, micro_batches=8, zero=1, overlap=True)
    est = price(shape, st, hw)
    assert est.step_time_s > 0 and 0 < est.mfu < 1
    assert est.layers_per_stage == [16, 16]
    assert est.tokens_per_step == 8 * 8 * 8192
    # More data parallelism at the same per-replica work: the same stage times, more reduction.
    wider = price(shape, dataclasses.replace(st, dp=16), hw)
    assert wider.step_time_s >= est.step_time_s
    # ZeRO-3 holds less state than ZeRO-1.
    z3 = price(shape, dataclasses.replace(st, zero=3), hw)
    assert max(z3.state_bytes_per_lane) < max(est.state_bytes_per_lane)
    out = est.to_dict()
    assert out["strategy"]["cp"] == 2 and out["peak_bytes_per_rank"][0] == est.peak_bytes_per_lane[0]


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape(2, 64, 4, kv_heads=3)
    with pytest.raises(ValueError, match="mlp must be one of"):
        ModelShape(2, 64, 4, mlp="relu")
    with pytest.raises(ValueError, match="unknown preset"):
        preset("llama9")
    assert set(PRESETS) >= {"gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b"}
    assert preset("gpt3-175b").attention == "plain" and preset("llama3-405b").attention == "fused"


def test_interleaved_peak_by_hand() -> None:
    # p 2, v 2, m 2, rank 1 warms up with (v - 1) p + 2 (p - 1 - 1) = 2 forwards (chunk 0 twice),
    # then forward 3 (chunk 1): it holds two of chunk 0 and one of chunk 1, never three of one.
    assert interleaved_peak(2, 2, 2, 1, (10, 1)) == 2 * 10 + 1
    assert interleaved_peak(2, 2, 2, 1, (1, 10)) == 2 * 1 + 10
    # Rank 0's warm-up (4 forwards) is the whole step: everything at once.
    assert interleaved_peak(2, 2, 2, 0, (10, 1)) == 2 * (10 + 1)
    # Llama 3 405B, pp 16 x 4 chunks, 32 micro-batches: rank 0's chunks hold 1, 2, 2, 2 layers.
    # Warm-up 3 * 16 + 2 * 15 = 78 forwards, then the 79th: forwards 0-15 and 64-78 ran chunk 0
    # (31 of 1 layer), 16-31, 32-47, 48-63 chunks 1-3 (16 each of 2 layers): 127 layers, not the
    # 79 x 2 = 158 of counting every held chunk at the rank's largest.
    assert interleaved_peak(16, 4, 32, 0, (1, 2, 2, 2)) == 31 + 3 * 16 * 2
    # Equal chunks: the warm-up plus one, each the same size.
    assert interleaved_peak(16, 4, 32, 1, (2, 2, 2, 2)) == (3 * 16 + 2 * 14 + 1) * 2
    with pytest.raises(ValueError, match="multiple of pp"):
        interleaved_peak(4, 2, 6, 0, (1, 2))


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (3, 2, 6), (4, 3, 8), (4, 4, 4), (5, 2, 15), (8, 4, 16)])
def test_interleaved_peak_equals_the_schedule_walk(p: int, v: int, m: int) -> None:
    """Against the runtime's own interleaved order, walked action by action, on uneven chunks."""
    act = tuple(7 + (s * 37) % 23 for s in range(p * v))
    walked = peak_in_flight(lane_flight_events("Interleaved1F1B", p * v, m, v), act)
    assert tuple(interleaved_peak(p, v, m, k, act[k::p]) for k in range(p)) == walked


def test_llama3_405b_interleaved_activations_by_hand() -> None:
    shape = preset("llama3-405b").sized(1)
    st = FamilyStrategy(64, 8, 16, 1, True, "none", 1, 32, "Interleaved1F1B", 4, True)
    layer = activation_bytes(shape, st)
    held = memory(shape, st).activations
    assert held[0] == 127 * layer  # chunks of 1, 2, 2, 2 layers (test_interleaved_peak_by_hand)
    assert held[1] == (3 * 16 + 2 * 14 + 1) * 2 * layer  # 77 chunks of 2 layers: the busiest rank


def test_llama3_405b_one_layer_chunks_by_hand() -> None:
    """Llama 3's own layout (section 3.3.2): 8 one-layer chunks per rank, the first holding only
    the embedding and the last only the output layer, in Megatron-LM's order (``N = pp``)."""
    shape = preset("llama3-405b").sized(1)
    st = FamilyStrategy(64, 8, 16, 1, True, "none", 2, 32, "Interleaved1F1B", 8, True)
    layer = activation_bytes(shape, st)
    mem = memory(shape, st)
    # Rank 0 warms up with 7 * 16 + 2 * 15 = 142 forwards, then the 143rd: forwards 0-15 and
    # 128-142 ran the embedding-only chunk (no activations without dropout), 16-127 the seven
    # one-layer chunks, 16 each: 112 layers.
    assert interleaved_peak(16, 8, 32, 0, (0, 1, 1, 1, 1, 1, 1, 1)) == 7 * 16
    assert mem.activations[0] == 112 * layer
    # Rank 1: equal chunks, the warm-up 7 * 16 + 2 * 14 forwards plus one: 141 layers, against
    # the 154 of four two-layer chunks (test_llama3_405b_interleaved_activations_by_hand).
    assert mem.activations[1] == (7 * 16 + 2 * 14 + 1) * layer
    # The same counts as the runtime's interleaved order walked action by action.
    walked = peak_in_flight(lane_flight_events("Interleaved1F1B", 128, 32, 8), mem.stage_activations)
    assert mem.activations == walked
    est = price(shape, st, load_profile("h100-sxm"))
    assert est.layers_per_stage == [0] + [1] * 126 + [0]
    assert est.peak_bytes == est.peak_bytes_per_lane[1]
    with pytest.raises(ValueError, match="cannot fill"):
        memory(dataclasses.replace(shape, layers=125), st)


def test_elementwise_and_optimizer_are_the_fused_kernels_bytes() -> None:
    """The family model lists fused kernels; the traced model's ops-per-kernel does not divide them."""
    hw = load_profile("a100-sxm")
    shape = ModelShape(4, 1024, 16, 512, 8192)
    st = FamilyStrategy()
    one = price(shape, st, hw)
    other = price(shape, st, dataclasses.replace(hw, elementwise_fusion=7.0))
    assert one.step_time_s == other.step_time_s
    # One rank, no reduction: the tail is the Adam kernel streaming 28 bytes per parameter.
    assert OPTIMIZER_STREAM_BYTES == 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2
    assert one.tail_s == [pytest.approx(28 * shape.parameters / hw.memory_Bps + hw.kernel_launch_s, rel=1e-12)]


def test_ring_context_parallel_hides_its_sends_behind_the_attention_core() -> None:
    """cp 4, tp 1, an 8k Llama 3 8B sequence on H100s: the all-gather option pays its gathers
    exposed; the ring sends one rank's key/value block per step, each hidden behind a quarter of
    the attention core, and pays only the gradients' last send home in backward."""
    hw = load_profile("h100-sxm")
    shape = preset("llama3-8b")
    gather = layer_costs(shape, FamilyStrategy(cp=4), hw)
    ring = layer_costs(shape, FamilyStrategy(cp=4, cp_comm="ring"), hw)
    assert ring.compute_forward == gather.compute_forward and ring.compute_backward == gather.compute_backward
    assert gather.forward > gather.compute_forward
    assert ring.forward == pytest.approx(ring.compute_forward, rel=1e-12)
    block = layer_messages(shape, FamilyStrategy(cp=4))["cp"] / 4  # one rank's keys and values
    home = collective_time("send", block, 2, hw.intra_node)
    assert ring.backward - (ring.compute_backward - ring.weight) == pytest.approx(home, rel=1e-12)
    with pytest.raises(ValueError, match="cp_comm must be allgather or ring"):
        FamilyStrategy(cp=2, cp_comm="tree")


@pytest.mark.parametrize(("name", "share"), [("a100-sxm", 0.25), ("h100-sxm", 0.5)])
def test_fused_attention_pays_its_exponentials(name: str, share: float) -> None:
    """Fused attention takes one exponential per score it computes forward and one again
    backward, at the special function units' rate: 16 per clock per SM against 2048 (A100) or
    4096 (H100) tensor FLOPs, so at head dim 128 (512 GEMM FLOPs per score) a quarter or half
    of the forward GEMMs' time at peak. Plain attention's softmax is priced by its bytes."""
    hw = load_profile(name)
    assert hw.exp_per_s is not None
    per_score_gemm = 512 / hw.flops_per_s["bfloat16"]
    assert (1 / hw.exp_per_s) / per_score_gemm == pytest.approx(share, rel=1e-12)
    shape = preset("llama3-8b")  # head dim 4096 / 32 = 128, seq 8192
    st = FamilyStrategy(tp=2, cp=2)
    free = dataclasses.replace(hw, exp_per_s=None)
    with_exps, without = layer_costs(shape, st, hw), layer_costs(shape, st, free)
    t = shape.seq // st.cp  # local queries, each against the whole sequence, causal half
    scores = t * shape.seq * (shape.heads // st.tp) / 2
    assert with_exps.forward - without.forward == pytest.approx(scores / hw.exp_per_s, rel=1e-9)
    assert with_exps.backward - without.backward == pytest.approx(scores / hw.exp_per_s, rel=1e-9)
    assert with_exps.weight == without.weight
    plain = dataclasses.replace(shape, attention="plain")
    assert layer_costs(plain, st, hw) == layer_costs(plain, st, free)


def test_exp_rate_round_trips_and_refuses_nonsense() -> None:
    hw = load_profile("h100-sxm")
    assert HardwareProfile.from_dict(hw.to_dict()) == hw
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ValueError, match=f"exp_per_s must be exponentials/s > 0 or null, got {bad!r}"):
            HardwareProfile.from_dict({**hw.to_dict(), "exp_per_s": bad})
