"""``python -m simulator estimate``: activations per layer (seed 003's GPT-3 table), model state,
pipeline peaks and step time read off a shape-only trace; the scaled estimate against a trace
of every layer and against a numerically run model."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout

import numpy as np
import pytest

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from simulator.cost import load_profile
from simulator.estimate import estimate, main, parse_count
from simulator.op_cost import PlanCosts
from simulator.step_trace import GPTShape, GPTStrategy, Part, trace_gpt_step

MiB = 2**20
GPT3 = GPTShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257, micro_batch_size=1)

# Seed 003 §2.2.3.5 (Megatron, Korthikanti et al. 2022), GPT-3 175B, s=2048, h=12288, a=96, b=1,
# t=8, 16-bit training: MiB of activations per layer per rank.
SEED_TABLE = [
    ("none", dict(tp=1), 2736),
    ("tensor parallel", dict(tp=8), 552),
    ("tensor + sequence parallel", dict(tp=8, sequence_parallel=True), 342),
    ("+ selective recompute", dict(tp=8, sequence_parallel=True, recompute="selective"), 102),
    ("full recompute (tp, no sp: the layer input 2sbh)", dict(tp=8, recompute="full"), 48),
]


def _layer_bytes(strategy: GPTStrategy) -> tuple[int, list]:
    step = trace_gpt_step(GPT3, strategy)
    per_rank = step.activations[Part("layer", 0)]
    assert len(set(per_rank.values())) == 1  # every rank of the layer keeps the same
    return next(iter(per_rank.values())), step.layer_kept


@pytest.mark.parametrize(("name", "kw", "mib"), SEED_TABLE, ids=[t[0] for t in SEED_TABLE])
def test_gpt3_activations_per_layer_reproduce_the_seed_table(name: str, kw: dict, mib: int) -> None:
    got, kept = _layer_bytes(GPTStrategy(mixed_precision=True, **kw))
    assert abs(got / MiB - mib) <= 0.01 * mib, (name, got / MiB)
    # Exactly Megatron's count, apart from what it leaves out: LayerNorm's saved mean and
    # 1/std (two values per row per norm, in the activation dtype here).
    stats = sum(k.nbytes for k in kept if k.op == "layer_norm" and k.role in ("output 1", "output 2"))
    assert got - stats == mib * MiB
    masks = [k for k in kept if k.op == "dropout"]
    assert all(k.dtype == "bool" for k in masks)
    assert len(masks) == (0 if kw.get("recompute") == "full" else 3 if kw.get("recompute") != "selective" else 2)


def test_what_a_sequence_parallel_layer_keeps() -> None:
    """The gathered input of q/k/v and fc1 is kept as its sequence shard (a re-gather note);
    under selective recompute the attention core keeps only q, k, v."""
    _, kept = _layer_bytes(GPTStrategy(tp=8, sequence_parallel=True, recompute="selective", mixed_precision=True))
    sbh_t = 2048 * 12288 // 8
    notes = [k for k in kept if k.role.endswith("(note)")]
    assert [(k.op, k.local_shape, k.nbytes) for k in notes] == [("matmul", (1, 256, 12288), 2 * sbh_t)] * 2
    assert sorted(k.role for k in kept if k.op == "recompute") == ["input 0", "input 1", "input 2"]
    assert not [k for k in kept if k.op in ("softmax", "dropout") and k.local_shape[-1] == 2048]
    _, full = _layer_bytes(GPTStrategy(tp=8, recompute="full", mixed_precision=True))
    assert [(k.op, k.role, k.local_shape, k.dtype) for k in full] == [
        ("recompute", "input 0", (1, 2048, 12288), "float16")
    ]


def test_cli_json_has_the_contract_fields() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            main(
                [
                    "--layers",
                    "96",
                    "--hidden",
                    "12288",
                    "--heads",
                    "96",
                    "--seq",
                    "2048",
                    "--vocab",
                    "50257",
                    "--mesh",
                    "tp=8",
                    "--sequence-parallel",
                    "--mixed-precision",
                    "--json",
                ]
            )
            == 0
        )
    data = json.loads(out.getvalue())
    assert data["format"] == "mpipar.estimate"
    assert data["activation_bytes_per_layer"] == 342 * MiB + 2 * 2 * 2048 * 2 // 8  # + LayerNorm statistics
    assert len(data["peak_bytes_per_rank"]) == len(data["model_state_bytes_per_rank"]) == 8
    assert data["step_time_s"] > 0
    assert all(p > s for p, s in zip(data["peak_bytes_per_rank"], data["model_state_bytes_per_rank"], strict=True))


STRATEGIES = [
    GPTStrategy(2, 2, 3, True, "selective", 1, True, "adamw", 4, "1F1B"),
    GPTStrategy(2, 2, 3, False, "full", 3, True, "adamw", 4, "ZBH1"),
    GPTStrategy(2, 2, 2, True, "none", 2, True, "adamw", 4, "Interleaved1F1B", 2),
    GPTStrategy(1, 2, 3, False, "none", 0, False, "momentum", 5, "FThenB"),
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: f"{s.schedule}-zero{s.zero}-{s.recompute}")
def test_scaled_estimate_equals_a_trace_of_every_layer(strategy: GPTStrategy) -> None:
    shape = GPTShape(layers=12, hidden=64, heads=4, seq=32, vocab=96, micro_batch_size=2)
    scaled = estimate(shape, strategy)
    assert scaled.layers_traced == 2 * strategy.num_stages < shape.layers
    full = estimate(shape, strategy, step=trace_gpt_step(shape, strategy, layers_traced=shape.layers))
    assert full.layers_traced == shape.layers
    assert scaled.peak_bytes_per_rank == full.peak_bytes_per_rank
    assert scaled.model_state_by_category == full.model_state_by_category
    for a, b in zip(scaled.stages, full.stages, strict=True):
        for name in ("forward_s", "backward_input_s", "backward_weight_s", "send_forward_s"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12), (a.stage, name)
        assert a.activation_bytes_per_microbatch == b.activation_bytes_per_microbatch
    assert scaled.step_time_s == pytest.approx(full.step_time_s, rel=1e-12)


def test_memory_matches_a_numerically_run_model() -> None:
    """The shape-only estimate against ``memory_report`` of the same GPT trained for real on 4 virtual ranks."""
    shape = GPTShape(layers=2, hidden=32, heads=4, seq=16, vocab=64, micro_batch_size=2)
    strategy = GPTStrategy(dp=2, tp=2, sequence_parallel=True, recompute="selective", zero=1)
    est = estimate(shape, strategy)
    dist.seed(0)
    par = GPTParallel.from_degrees(2, 2, 1, sequence_parallel=True, recompute="selective")
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1), par)
    opt = dist.shard_optimizer(dist.optimizer.AdamW(parameters=model.parameters()), dist.ShardingStage1("dp"))
    rng = np.random.default_rng(0)
    mesh = par.stage_meshes[0]
    x, y = (
        dist.shard_tensor(rng.integers(0, 64, (4, 16)), mesh, par.activation(mesh, seq_split=False)) for _ in range(2)
    )
    loss = model.loss(x, y)
    saved = dist.memory_report(model, opt, loss)
    loss.backward()
    opt.step()
    after = dist.memory_report(model, opt)
    for r in range(4):
        assert est.peak_bytes_per_rank[r] - est.model_state_bytes_per_rank[r] == saved.per_rank[r]["activations"]
        for cat in ("parameters", "gradients", "optimizer_state"):
            assert est.model_state_by_category[cat][r] == after.per_rank[r][cat], (r, cat)


@pytest.mark.parametrize(("kind", "m"), [("1F1B", 8), ("1F1B", 2), ("FThenB", 6)])
def test_peak_holds_the_micro_batches_the_schedule_keeps_in_flight(kind: str, m: int) -> None:
    p = 4
    shape = GPTShape(layers=8, hidden=32, heads=2, seq=16, vocab=64)
    est = estimate(shape, GPTStrategy(dp=2, pp=p, micro_batches=m, schedule=kind))
    for i, stage in enumerate(est.stages):
        in_flight = min(p - i, m) if kind == "1F1B" else m
        assert stage.peak_in_flight == in_flight
        for r in stage.ranks:
            held = est.peak_bytes_per_rank[r] - est.model_state_bytes_per_rank[r]
            assert held == in_flight * stage.activation_bytes_per_microbatch


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_mixed_precision_model_state_is_2_2_12_bytes_split_by_zero(zero: int) -> None:
    """ZeRO paper's accounting: 16-bit parameters (2) and gradients (2), float32 master,
    moment1, moment2 (12); stage 1 splits the 12 over dp, stage 2 also the gradients, stage 3
    all -- for each parameter the ZeRO layout rule can split (column-parallel biases, already
    split over tp on their only dim, stay whole)."""
    dp = 4
    shape = GPTShape(layers=2, hidden=64, heads=4, seq=16, vocab=128)
    est = estimate(shape, GPTStrategy(dp=dp, tp=2, zero=zero, mixed_precision=True))
    model = GPT(
        GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=64), GPTParallel.from_degrees(dp, 2, 1)
    )
    rule = dist.ShardingStage1("dp")
    for r in range(dp * 2):
        whole = split = 0  # elements rank r holds of each parameter, and in its ZeRO layout
        for p in model.parameters():
            n = int(np.prod(p.spec.local_shape(r)))
            layout = rule.layout(p)
            whole += n
            split += n if layout is None else int(np.prod(layout.local_shape(r)))
        assert split < whole
        want = {
            "parameters": 2 * (split if zero == 3 else whole),
            "gradients": 2 * (split if zero >= 2 else whole),
            "optimizer_state": 12 * (split if zero >= 1 else whole),
        }
        got = {c: est.model_state_by_category[c][r] for c in want}
        assert got == want, (r, zero)


def test_layer_matmul_flops_are_megatrons() -> None:
    """Forward matmuls of one layer: 24 b s h^2 + 4 b s^2 h (Narayanan et al. 2021); backward twice that."""
    shape = GPTShape(layers=2, hidden=256, heads=4, seq=128, vocab=512, micro_batch_size=3)
    step = trace_gpt_step(shape, GPTStrategy())
    costs = PlanCosts(step.plan, load_profile("h100-nvlink-ib"))
    flops = {"forward": 0.0, "backward": 0.0}
    for op, part in zip(step.plan.ops, step.op_parts, strict=True):
        if op.op == "matmul" and part == Part("layer", 0):
            flops[op.phase] += costs.op_flops(op, 0)
    b, s, h = 3, 128, 256
    assert flops["forward"] == 24 * b * s * h * h + 4 * b * s * s * h
    assert flops["backward"] == 2 * flops["forward"]
    weight = sum(costs.op_flops(step.plan.ops[i], 0) for i in step.weight_ops if step.op_parts[i] == Part("layer", 0))
    assert weight == 24 * b * s * h * h  # the six linear layers; attention has no weights


def test_gpt3_175b_on_1024_ranks() -> None:
    """The acceptance configuration: dp 8 x tp 8 x pp 16, 64 micro-batches, 1F1B (timed in
    benchmarks/estimate_scale.py, not here)."""
    strategy = GPTStrategy(
        dp=8,
        tp=8,
        pp=16,
        sequence_parallel=True,
        recompute="selective",
        zero=1,
        mixed_precision=True,
        micro_batches=64,
        schedule="1F1B",
    )
    est = estimate(GPTShape.from_params(175e9), strategy)
    assert est.layers_traced == 32 and est.shape.layers == 96
    assert [s.layers for s in est.stages] == [6] * 16
    assert sorted(est.peak_bytes_per_rank) == list(range(1024))
    assert est.activation_bytes_per_layer == 102 * MiB + 2 * 2 * 2048 * 2 // 8
    for i, stage in enumerate(est.stages):
        assert stage.peak_in_flight == 16 - i
        for r in stage.ranks:
            assert est.peak_bytes_per_rank[r] == (
                est.model_state_bytes_per_rank[r] + (16 - i) * stage.activation_bytes_per_microbatch
            )
    middle = est.stages[5]
    assert middle.activation_bytes_per_microbatch == 6 * est.activation_bytes_per_layer
    assert (
        est.step_time_s > est.pipeline_s > 64 * (middle.forward_s + middle.backward_input_s + middle.backward_weight_s)
    )
    assert 0 < est.bubble_fraction < 1


def test_parameter_count_and_shapes_for_a_count() -> None:
    def dims(s: GPTShape) -> tuple[int, int, int]:
        return s.layers, s.hidden, s.heads

    assert dims(GPTShape.from_params(175e9)) == (96, 12288, 96)  # GPT-3 175B
    assert dims(GPTShape.from_params(parse_count("6.7B"))) == (32, 4096, 32)  # GPT-3 6.7B
    assert parse_count("350M") == 350e6 and parse_count("1.3b") == 1.3e9
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=3, n_head=4, n_embd=64)
    assert GPTShape(layers=3, hidden=64, heads=4, seq=32, vocab=96).parameters == GPT(cfg).num_parameters()


def test_schedules_order_as_expected() -> None:
    shape = GPTShape(layers=8, hidden=64, heads=4, seq=32, vocab=96)
    base = dict(dp=2, pp=4, micro_batches=8)
    times = {k: estimate(shape, GPTStrategy(schedule=k, **base)).step_time_s for k in ("FThenB", "1F1B", "ZBH1")}
    assert times["ZBH1"] < times["1F1B"]  # W fills the bubble
    assert times["1F1B"] == pytest.approx(times["FThenB"], rel=0.05)  # same bubble, other order
    peaks = {
        k: max(estimate(shape, GPTStrategy(schedule=k, **base)).peak_bytes_per_rank.values())
        for k in ("FThenB", "1F1B")
    }
    assert peaks["1F1B"] < peaks["FThenB"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "1e9", "--layers", "4"], "drop --layers"),
        (["--layers", "4", "--hidden", "64"], "needs --heads"),
        (["--params", "1e9", "--mesh", "dp=two"], "cannot read 'dp=two'"),
        (["--params", "lots"], "cannot read 'lots'"),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--mesh", "pp=4"],
            r"layers \(2\) < pipeline stages pp\(4\)",
        ),
        (["--layers", "2", "--hidden", "64", "--heads", "5"], "divisible by heads"),
        (["--params", "1e9", "--hardware", "tpu-v9"], "no hardware profile 'tpu-v9'"),
        (["--params", "1e9", "--schedule", "2F2B"], "unknown pipeline schedule kind"),
    ],
)
def test_bad_command_lines_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_gradient_clipping_is_traced_and_priced_per_parameter() -> None:
    """``ClipGradByGlobalNorm`` in shape-only mode: a square and a sum per gradient, a scale per
    gradient (the step that clips), each labelled by its parameter's layer and scaled with it."""
    shape = GPTShape(layers=6, hidden=32, heads=2, seq=16, vocab=64)
    strategy = GPTStrategy(dp=2, pp=2, grad_clip=1.0)
    step = trace_gpt_step(shape, strategy)
    layer0 = [
        op.op
        for op, part in zip(step.plan.ops, step.op_parts, strict=True)
        if op.phase == "optimizer" and part == Part("layer", 0)
    ]
    per_layer = 16  # parameters of one block: q, k, v, proj, fc, proj weights and biases, two norms
    assert (layer0.count("square"), layer0.count("sum"), layer0.count("scale")) == (per_layer,) * 3
    plain = estimate(shape, GPTStrategy(dp=2, pp=2), op_overhead=1e-4)
    clipped = estimate(shape, strategy, op_overhead=1e-4, step=step)
    # 3 parameters' ops more per parameter of every real layer (and of the embeddings and head)
    extra = sum(clipped.tail_s) - sum(plain.tail_s)
    n_params = 6 * per_layer + 2 + 4  # the layers, wte and wpe, ln_f and the head
    assert extra >= 3 * n_params * 1e-4 * 0.999


def test_cli_writes_the_traced_plan(tmp_path: object) -> None:
    from mpipar.compile.plan import Plan

    path = f"{tmp_path}/plan.json"
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            main(
                [
                    "--layers",
                    "4",
                    "--hidden",
                    "64",
                    "--heads",
                    "2",
                    "--seq",
                    "16",
                    "--vocab",
                    "64",
                    "--mesh",
                    "dp=2,pp=2",
                    "--plan",
                    path,
                ]
            )
            == 0
        )
    plan = Plan.load(path)
    assert plan.meta["shape_only"] and plan.meta["layers_traced"] == 4
    assert plan.comm_counts("forward") == {"transfer": 1}  # the one pipeline hand-off
    assert f"wrote {path}" in out.getvalue() and "step time" in out.getvalue()
