"""The Llama model and context parallelism: one-device losses on every mesh and launch mode,
pinned cp collectives, Hugging Face weights into any mesh, published shapes' parameter counts.

* in-process (simulator): the tiny Llama's loss and every gradient on dp, tp (key/value heads
  split and replicated), sequence, pipeline and context parallel meshes, fused and plain
  attention == the single device's, float64;
* (``tests/mpi/test_llama_modes.py``: the same meshes in the three launch modes);
* the cp collectives: forward one all_gather of keys and one of values per layer on the cp
  axis, backward one reduce_scatter of each gradient; ``mpipar plan`` of ``llama.py`` records
  them and the dashboard's communication table lists them on the cp axis;
* ``load_hf_llama``: a checkpoint written by ``safetensors`` into several meshes gives its
  weights back and the same logits; a hostile file is refused by name.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from processes import environ, run_python

import mpipar as dist
from mpipar.comm import CommEvent
from mpipar.compile.plan import Plan
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.models.llama import (
    LLAMA3_CONFIGS,
    Llama,
    LlamaConfig,
    LlamaParallel,
    hf_state_dict,
    llama_config,
    load_hf_llama,
)
from viz import comm
from viz.layout import layout_text
from viz.planinfo import tensor_spec

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CFG = llama_config("tiny", dtype="float64")
MESHES = {
    "single": {},
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "tp4-kv-replicated": {"tp": 4},
    "tp2-sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "cp2": {"cp": 2},
    "cp4": {"cp": 4},
    "dp2-cp2-tp2-sp": {"dp": 2, "cp": 2, "tp": 2, "sequence_parallel": True},
    "cp4-ring": {"cp": 4, "cp_comm": "ring"},
    "cp2-tp4-ring-kv-replicated": {"cp": 2, "tp": 4, "cp_comm": "ring"},
    "cp2-pp2-full-recompute": {"cp": 2, "pp": 2, "recompute": "full"},
}


def _batch(par: GPTParallel, seed: int = 0, length: int = 16) -> tuple[dist.Tensor, dist.Tensor]:
    """Tokens and targets, batch split on dp."""
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 128, (4, length)), rng.integers(0, 128, (4, length))
    if not par.distributed:
        return dist.Tensor(x), dist.Tensor(y)
    out = []
    for arr, mesh in ((x, par.stage_meshes[0]), (y, par.stage_meshes[-1])):
        pls = [p if p.is_shard(0) else dist.Replicate() for p in par.activation(mesh, seq_split=False)]
        out.append(dist.shard_tensor(arr, mesh, pls))
    return out[0], out[1]


def _loss_and_grads(cfg: LlamaConfig, par: GPTParallel) -> tuple[float, dict[str, np.ndarray]]:
    dist.seed(5)
    model = Llama(cfg, par)
    loss = model.loss(*_batch(par))
    loss.backward()
    return float(loss), {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["fused", "plain"])
def test_every_mesh_computes_the_single_devices_loss_and_gradients(attention: str) -> None:
    cfg = llama_config("tiny", dtype="float64", attention=attention)
    want, want_g = _loss_and_grads(cfg, LlamaParallel())
    for name, degrees in MESHES.items():
        got, got_g = _loss_and_grads(cfg, LlamaParallel.from_degrees(**degrees))  # type: ignore[arg-type]
        assert got == pytest.approx(want, rel=1e-12), name
        for key, g in want_g.items():
            np.testing.assert_allclose(got_g[key], g, rtol=1e-9, atol=1e-13, err_msg=f"{name} {key}")


@pytest.mark.parametrize(("layers", "pp", "chunks"), [(5, 2, 1), (7, 4, 1), (5, 2, 2)])
def test_layers_that_do_not_divide_go_where_the_estimator_prices_them(layers: int, pp: int, chunks: int) -> None:
    """An uneven split in the runtime is ``stage_layer_counts``' (the first and last stages,
    which also hold the embedding and the output layer, lighter), the split the estimator and
    the search price; the losses and gradients stay the single device's."""
    cfg = llama_config("tiny", dtype="float64", num_hidden_layers=layers)
    par = LlamaParallel.from_degrees(pp=pp, chunks=chunks)  # type: ignore[arg-type]
    counts = dist.pipeline.stage_layer_counts(layers, pp, chunks)
    assert [par.stage_of_layer(i, layers) for i in range(layers)] == dist.pipeline.stage_of_layers(layers, pp, chunks)
    dist.seed(5)
    model = Llama(cfg, par)
    held = Counter(model.layers[i].self_attn.q_proj.weight.process_mesh for i in range(layers))  # type: ignore[attr-defined]
    want_held = Counter()
    for stage, n in enumerate(counts):
        want_held[par.stage_meshes[stage % pp]] += n
    assert held == want_held and len(set(counts)) > 1
    want, want_g = _loss_and_grads(cfg, LlamaParallel())
    got, got_g = _loss_and_grads(cfg, par)
    assert got == pytest.approx(want, rel=1e-12)
    for key, g in want_g.items():
        np.testing.assert_allclose(got_g[key], g, rtol=1e-9, atol=1e-13, err_msg=key)


def test_fused_and_plain_attention_train_the_same_llama() -> None:
    fused, fused_g = _loss_and_grads(CFG, LlamaParallel.from_degrees(cp=2, tp=2))
    plain, plain_g = _loss_and_grads(llama_config("tiny", dtype="float64", attention="plain"), LlamaParallel())
    assert fused == pytest.approx(plain, rel=1e-12)
    for key, g in plain_g.items():
        np.testing.assert_allclose(fused_g[key], g, rtol=1e-9, atol=1e-13)


def _step_comm(par: GPTParallel) -> tuple[list[CommEvent], list[CommEvent]]:
    dist.seed(5)
    model = Llama(CFG, par)
    x, y = _batch(par)
    with dist.CommDebugMode() as fwd:
        loss = model.loss(x, y)
    with dist.CommDebugMode() as bwd:
        loss.backward()
    return fwd.events, bwd.events


def test_context_parallel_gathers_keys_and_values_once_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """cp=2 alone: forward is exactly an all_gather of keys and one of values per layer (the loss
    runs on the split sequence); backward reduce-scatters their gradients and all-reduces the
    weights' gradients (cp acts as data parallel for weights)."""
    # one all-reduce per gradient, as pinned below (the default buckets would fuse them into one)
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")
    fwd, bwd = _step_comm(LlamaParallel.from_degrees(cp=2))
    layers = CFG.num_hidden_layers
    assert Counter(e.op for e in fwd) == Counter({"all_gather": 2 * layers})
    assert all("scaled_dot_product_attention input" in e.context for e in fwd)
    counts = Counter(e.op for e in bwd)
    assert counts["reduce_scatter"] == 2 * layers
    assert counts["all_reduce"] == len(list(Llama(CFG, LlamaParallel.from_degrees(cp=2)).parameters()))
    # keys and values are gathered whole: each rank receives the other half of (B, T, Hkv, D)
    kv_bytes = 4 * 16 * CFG.num_key_value_heads * CFG.head_dim * 8
    assert all(e.input_nbytes == kv_bytes // 2 and e.output_nbytes == kv_bytes for e in fwd)


def test_ring_context_parallel_sends_blocks_around_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """cp=4, ``cp_comm="ring"``: no all_gather of keys and values; forward sends each rank's key
    block and value block on cp-1 times per layer, backward the blocks cp-1 times and their
    gradients cp times, each send to the next rank of the cp ring."""
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")
    cp, layers = 4, CFG.num_hidden_layers
    fwd, bwd = _step_comm(LlamaParallel.from_degrees(cp=cp, cp_comm="ring"))
    assert Counter(e.op for e in fwd) == Counter({"send": 2 * layers * (cp - 1) * cp})
    sends = [e for e in (*fwd, *bwd) if e.op == "send"]
    assert all("ring attention" in e.context and e.ranks[1] == (e.ranks[0] + 1) % cp for e in sends)
    assert len(sends) - len(fwd) == 2 * layers * ((cp - 1) + cp) * cp
    assert "all_gather" not in Counter(e.op for e in bwd)
    block = 4 * (16 // cp) * CFG.num_key_value_heads * CFG.head_dim * 8  # (B, T/cp, Hkv, D) float64
    assert all(e.input_nbytes == block for e in fwd)


def test_context_parallel_with_tensor_parallel_splits_heads_and_sequence() -> None:
    fwd, _ = _step_comm(LlamaParallel.from_degrees(cp=2, tp=2))
    gathers = [e for e in fwd if "scaled_dot_product_attention input" in e.context]
    # per layer: keys and values, in each of the tp=2 cp groups
    assert len(gathers) == 2 * CFG.num_hidden_layers * 2
    assert all(len(e.ranks) == 2 and e.ranks[1] - e.ranks[0] == 2 for e in gathers)  # cp groups stride tp


def test_llama3_parameter_counts_are_the_published_shapes() -> None:
    """Hand-computed from the shapes: 2 V h (embedding, untied output) + L (2 h^2 [q, o] +
    2 h (kv x 128) [k, v] + 3 h f [gate, up, down] + 2 h [norms]) + h [final norm]."""
    v = 128256
    want = {
        "llama3-8b": 2 * v * 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096,
        "llama3-70b": 2 * v * 8192 + 80 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192) + 8192,
        "llama3-405b": 2 * v * 16384 + 126 * (2 * 16384**2 + 2 * 16384 * 1024 + 3 * 16384 * 53248 + 2 * 16384) + 16384,
    }
    assert {k: c.num_parameters() for k, c in LLAMA3_CONFIGS.items()} == want
    assert want["llama3-8b"] == 8_030_261_248 and want["llama3-70b"] == 70_553_706_496  # the model cards
    assert want["llama3-405b"] == 405_853_388_800
    for c in LLAMA3_CONFIGS.values():
        assert (c.vocab_size, c.rope_theta, c.num_key_value_heads, c.head_dim) == (128256, 500000.0, 8, 128)
    assert Llama(CFG).num_parameters() == CFG.num_parameters()  # the formula is the model's


def test_bad_configs_and_sequences_are_named_errors() -> None:
    with pytest.raises(ValueError, match="key/value heads the attention heads"):
        LlamaConfig(hidden_size=24, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="attention 'flash' is not one of plain, fused"):
        LlamaConfig(attention="flash")
    with pytest.raises(ValueError, match="unknown Llama config 'llama2'"):
        llama_config("llama2")
    par = LlamaParallel.from_degrees(cp=2)
    model = Llama(CFG, par)
    short = dist.shard_tensor(np.zeros((2, 8), dtype=np.int64), par.stage_meshes[0], [dist.Replicate()] * 3)
    with pytest.raises(ValueError, match="under context parallel the sequence must be max_position_embeddings 16"):
        model(short)


# ---------------------------------------------------------------------- Hugging Face weights
def _write_checkpoint(path: Path, seed: int = 11) -> dict[str, np.ndarray]:
    """Random weights in HF names and layouts, split over two shard files as large checkpoints are."""
    dist.seed(seed)
    weights = hf_state_dict(Llama(CFG))
    rng = np.random.default_rng(seed)
    weights = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in weights.items()}
    names = sorted(weights)
    path.mkdir()
    safetensors_numpy.save_file({k: weights[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    safetensors_numpy.save_file({k: weights[k] for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    return weights


def test_hf_checkpoint_loads_into_any_mesh(tmp_path: Path) -> None:
    weights = _write_checkpoint(tmp_path / "ckpt")
    logits = None
    for name in ("single", "tp2", "tp4-kv-replicated", "pp2", "cp2", "dp2-cp2-tp2-sp"):
        par = LlamaParallel.from_degrees(**MESHES[name])  # type: ignore[arg-type]
        model = Llama(CFG, par)
        load_hf_llama(model, str(tmp_path / "ckpt"))
        back = hf_state_dict(model)
        assert sorted(back) == sorted(weights)
        for key, w in weights.items():
            np.testing.assert_array_equal(back[key], w.astype(np.float64), err_msg=f"{name} {key}")
        if name == "tp4-kv-replicated":  # tp exceeds the 2 key/value heads: their projections replicated
            assert model.layers[0].self_attn.k_proj.weight.placements == [dist.Replicate(), dist.Replicate()]
        xs, _ = _batch(par)
        out = model(xs).full_tensor()
        if logits is None:
            logits = out
        np.testing.assert_allclose(out, logits, rtol=1e-10, atol=1e-12, err_msg=name)


def test_hostile_hf_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    weights = _write_checkpoint(tmp_path / "ok")
    model = Llama(CFG)

    def write(name: str, tensors: dict[str, np.ndarray]) -> str:
        path = str(tmp_path / name)
        safetensors_numpy.save_file(tensors, path)
        return path

    cases = {
        "extra.safetensors": ({**weights, "model.rotary_emb.inv_freq": np.zeros(2, np.float32)}, "rotary_emb"),
        "missing.safetensors": ({k: v for k, v in weights.items() if k != "lm_head.weight"}, "lacks 1 tensor"),
        "shape.safetensors": ({**weights, "model.norm.weight": np.zeros(5, np.float32)}, r"shape \[5\]"),
        "ints.safetensors": ({**weights, "model.norm.weight": np.zeros(16, np.int32)}, "must be floats"),
    }
    for name, (tensors, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_hf_llama(model, write(name, tensors))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_hf_llama(model, str(garbage))
    with pytest.raises(ValueError, match=r"neither a \.safetensors file nor a directory"):
        load_hf_llama(model, str(tmp_path / "nowhere"))


# ---------------------------------------------------------------------- GPT under cp, plans, launch modes
def test_gpt_under_context_parallel_equals_one_device() -> None:
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=16, dtype="float64")
    losses = {}
    for name, degrees, attention in (
        ("single", {}, "plain"),
        ("cp2", {"cp": 2}, "plain"),
        ("cp2-tp2", {"cp": 2, "tp": 2}, "fused"),
    ):
        par = GPTParallel.from_degrees(**degrees) if degrees else GPTParallel()  # type: ignore[arg-type]
        dist.seed(5)
        model = GPT(GPTConfig(**{**cfg.__dict__, "attention": attention}), par)
        losses[name] = float(model.loss(*_batch(par)))
    assert losses["cp2"] == pytest.approx(losses["single"], rel=1e-12)
    assert losses["cp2-tp2"] == pytest.approx(losses["single"], rel=1e-12)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=environ(drop=("MPIPAR_BACKEND",), one_thread=True))


def test_plan_and_dashboard_show_the_cp_collectives(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    run = _cli(
        "-m", "mpipar.cli", "plan", "-o", str(out), "-n", "4", "examples/llama.py", "--tiny", "--mesh", "cp=2,tp=2"
    )
    assert run.returncode == 0, run.stderr
    plan = Plan.load(str(out))
    gathers = [r for r in plan.reshards if r.phase == "forward" and "scaled_dot_product_attention input" in r.reason]
    assert len(gathers) == 2 * 2  # keys and values of each of the 2 layers
    assert all([(st.kind, st.axes) for st in r.steps] == [("all_gather", ("cp",))] for r in gathers)
    rows = comm.comm_table(plan, "forward")
    assert {"phase": "forward", "collective": "all_gather", "axes": "cp", "count": 4, "bytes/rank": 4096.0} in rows
    assert any(r["collective"] == "reduce_scatter" and r["axes"] == "cp" for r in comm.comm_table(plan, "backward"))
    assert json.loads(out.read_text())["meshes"][0]["dim_names"] == ["dp", "cp", "tp"]
    # The sequence split is the load-balanced placement, in the plan and in the layout view.
    zig = [t for t in plan.tensors if t.placements == "RZ(1)R" and len(t.shape) == 3]
    assert zig, "no activation split Z(1) on cp in the plan"
    spec = tensor_spec(plan, zig[0])
    assert spec is not None
    text = layout_text(spec, zig[0].name)
    assert "Zigzag: Z(1) on cp" in text and "[0,4)+[12,16)" in text


def test_llama_example_saves_and_resumes_on_another_mesh(tmp_path: Path) -> None:
    """``llama.py --save-every``: a run resumed on a cp x tp mesh prints the uninterrupted run's losses."""
    common = ["examples/llama.py", "--tiny", "--steps", "4", "--dtype", "float64", "--sample", "0"]
    whole = _cli(*common, "--save-every", "2", "--save-dir", str(tmp_path / "ck"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed = _cli(
        "-m", "simulator", "-n", "4", *common, "--mesh", "cp=2,tp=2", "--resume", str(tmp_path / "ck" / "step-2")
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = re.findall(r"^step [23] loss \S+$", whole.stdout, re.M)
    assert len(want) == 2 and re.findall(r"^step \d+ loss \S+$", resumed.stdout, re.M) == want


def test_the_saved_mask_is_in_natural_order_on_a_cp_mesh() -> None:
    """Plain attention under cp adds the natural-order mask to zigzag-split scores (the add's rule
    slices its rows alike), so the buffer a checkpoint holds loads on any mesh."""
    cfg = llama_config("tiny", dtype="float64", attention="plain")
    model = Llama(cfg, LlamaParallel.from_degrees(cp=2))
    state = model.state_dict()
    mask = state["layers.0.self_attn.causal_mask"].full_tensor()
    np.testing.assert_array_equal(mask, np.triu(np.full((16, 16), -1e9), k=1))
    assert sorted(k for k in state if "mask" in k) == [f"layers.{i}.self_attn.causal_mask" for i in range(2)]
