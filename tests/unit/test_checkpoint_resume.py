"""Resuming ``examples/gpt.py`` from a checkpoint continues the run it was cut from, bit for bit.

The oracle is the uninterrupted run: ``--save-every`` writes ``DIR/step-<k>`` while it trains,
``--save-final`` dumps its final state (weights, optimizer states, step, RNG, data position).
A second run ``--resume``s from step k and must print the same ``step <n> loss <v>`` lines
for the remaining steps and end in the same final state:

* same mesh: bit-identical (simulator, ``--reference``, MPI, and MPI <-> simulator);
* layout changes that keep every floating-point reduction (ZeRO 0 <-> 1, ZeRO 2 <-> 3,
  selective or full recompute, with or without tp and sequence parallel): bit-identical too;
  the ZeRO-split optimizer states are read into the new layout;
* mesh changes that reorder sums (another dp or tp degree, pipeline stages, ZeRO 0/1 <->
  2/3, sequence parallel): float64, within 1e-12 of the uninterrupted run, measured against
  the largest magnitude of each kind of state (see ``assert_close``).

Why the last group cannot be bit-identical: a dp degree splits the batch, so gradients and the
loss mean are sums of other partial sums; a tp degree splits the row-parallel matmuls'
contraction and, with sequence parallel, the LayerNorm gradients' sums over tokens; the
global-norm clip adds the squares per pipeline-stage mesh and over a dp-split gradient under
ZeRO-2/3. The uninterrupted runs on those meshes differ from each other in the last bits just
as much. (Recompute is not among them: a recomputed block hands its input's tp-partial gradient
back unreduced, so the caller sums it where the ordinary backward does.)

Run: ``.venv/bin/python -m pytest -q tests/unit/test_checkpoint_resume.py`` (``-m mpi`` for the
mpiexec variants).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import REPO
from processes import run

import mpipar as dist
from mpipar.checkpoint import (
    CheckpointError,
    load_training_state,
    read_state_dict,
    resolve_checkpoint,
    save_training_state,
    series_steps,
)
from mpipar.checkpoint.format import METADATA, PARTIAL_TAG
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.nn.layer import default_dtype

LOSS_LINE = re.compile(r"^step \d+ loss \S+$", re.M)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
GPT_PY = os.path.join("examples", "gpt.py")


# ============================================================================ helpers
def _env() -> dict[str, str]:
    drop = ("MPIPAR_BACKEND", "MPIPAR_TRACE")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"MPIPAR_TIMEOUT": "60"}


def gpt(launch: str, n: int, *args: str) -> list[str]:
    """Run examples/gpt.py --tiny (``launch``: sim, reference or mpi); its loss lines."""
    prefix = {
        "sim": [sys.executable, "-m", "simulator", "-n", str(n)],
        "reference": [sys.executable, "-m", "simulator", "--reference"],
        "mpi": [MPIEXEC, "-n", str(n), sys.executable],
    }[launch]
    proc = run([*prefix, GPT_PY, "--tiny", *args], env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return LOSS_LINE.findall(proc.stdout)


def final_state(path: Any) -> dict[str, Any]:
    """A saved training state, flattened to dotted names (the run's configuration left out)."""
    out: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = value

    state = read_state_dict(path)
    state.pop("extra")
    walk(state, "")
    return out


def assert_bit_identical(got_path: Any, want_path: Any) -> None:
    got, want = final_state(got_path), final_state(want_path)
    assert got.keys() == want.keys()
    differ = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray):
            if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
                differ.append(k)
        elif g != w:
            differ.append(k)
    assert not differ, f"{len(differ)} entries differ, e.g. {differ[:5]}"


def _kind(name: str) -> str:
    """model, or the optimizer state's name (moment1, moment2): what shares one scale."""
    return "model" if name.startswith("model.") else name.rsplit(".", 1)[1]


def assert_close(got_path: Any, want_path: Any, rtol: float = 1e-12) -> None:
    """Every array within ``rtol`` times the largest magnitude of its kind (all weights, all
    first moments, ...); plain values (step, RNG, data position, step counts) equal.

    Not per tensor: the key projections' biases get a zero gradient in exact arithmetic
    (softmax ignores a constant added to all of a query's scores), so they hold rounding noise
    of ~1e-15 whose digits depend on the summation order -- relative to themselves they differ
    completely, relative to the weights by 1e-14."""
    got, want = final_state(got_path), final_state(want_path)
    assert got.keys() == want.keys()
    scale: dict[str, float] = {}
    for k, w in want.items():
        if isinstance(w, np.ndarray) and w.size:
            scale[_kind(k)] = max(scale.get(_kind(k), 0.0), float(np.max(np.abs(w))))
    worst = {}
    for k, w in want.items():
        g = got[k]
        if isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape, k
            if w.size:
                worst[k] = float(np.max(np.abs(g.astype(np.float64) - w))) / scale[_kind(k)]
        else:
            assert g == w, (k, g, w)
    bad = {k: v for k, v in worst.items() if v > rtol}
    assert not bad, f"beyond {rtol} relative: {sorted(bad.items(), key=lambda kv: -kv[1])[:5]}"


def assert_losses_close(got: list[str], want: list[str], rtol: float = 1e-12) -> None:
    assert [line.rsplit(" ", 1)[0] for line in got] == [line.rsplit(" ", 1)[0] for line in want]
    g = np.array([float(line.rsplit(" ", 1)[1]) for line in got])
    w = np.array([float(line.rsplit(" ", 1)[1]) for line in want])
    np.testing.assert_allclose(g, w, rtol=rtol, atol=0)


def uninterrupted(
    tmp: Any, launch: str, n: int, mesh: list[str], steps: int = 5, every: int = 2, dtype: str = "float32"
) -> tuple[list[str], str, str]:
    """The oracle run: its loss lines, its checkpoint series and its final state."""
    series, final = str(tmp / "series"), str(tmp / "final")
    lines = gpt(
        launch,
        n,
        "--steps",
        str(steps),
        "--dtype",
        dtype,
        *mesh,
        "--save-every",
        str(every),
        "--save-dir",
        series,
        "--save-final",
        final,
    )
    assert len(lines) == steps
    assert series_steps(series) == list(range(every, steps + 1, every))
    return lines, series, final


Oracle = Callable[[str, int, list[str]], tuple[list[str], str, str]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    """``uninterrupted(..., launch, n, mesh)`` (5 steps, a save every 2), each configuration
    run once for the tests below that start from it; they read its series and final state,
    never write them."""
    runs: dict[tuple[str, int, tuple[str, ...]], tuple[list[str], str, str]] = {}

    def get(launch: str, n: int, mesh: list[str]) -> tuple[list[str], str, str]:
        key = (launch, n, tuple(mesh))
        if key not in runs:
            runs[key] = uninterrupted(tmp_path_factory.mktemp("oracle"), launch, n, mesh)
        return runs[key]

    return get


# ====================================================== same mesh: bit-identical
SAME_MESH = {
    "dp2xtp2": ("sim", 4, ["--mesh", "dp=2,tp=2"]),
    "dp2xtp2xpp2-zero2-sp-recompute": (
        "sim",
        8,
        ["--mesh", "dp=2,tp=2,pp=2", "--zero", "2", "--sequence-parallel", "--recompute", "full"],
    ),
    "dp3-zero3-accumulate": ("sim", 3, ["--mesh", "dp=3", "--zero", "3", "--accumulate-steps", "2"]),
    "reference": ("reference", 1, ["--mesh", "dp=2,tp=2", "--zero", "1"]),
    "dp2xpp2-1F1B-schedule": ("sim", 4, ["--mesh", "dp=2,pp=2", "--schedule", "1F1B"]),  # steps through dist.to_static
}


@pytest.mark.parametrize("case", list(SAME_MESH))
def test_resume_on_the_same_mesh_is_bit_identical(tmp_path: Any, oracle: Oracle, case: str) -> None:
    launch, n, mesh = SAME_MESH[case]
    lines, series, final = oracle(launch, n, mesh)
    # From step-2 (named), then from the series directory: its latest complete one, step-4.
    resumed = gpt(
        launch, n, "--steps", "5", *mesh, "--resume", f"{series}/step-2", "--save-final", str(tmp_path / "r2")
    )
    assert resumed == lines[2:]
    assert_bit_identical(tmp_path / "r2", final)
    resumed = gpt(launch, n, "--steps", "5", *mesh, "--resume", series, "--save-final", str(tmp_path / "r4"))
    assert resumed == lines[4:]
    assert_bit_identical(tmp_path / "r4", final)


# ============================= layout changes that keep every reduction: bit-identical
KEEPS_REDUCTIONS = {
    # ZeRO-1 keeps gradients and the update's arithmetic; only where the states live changes.
    "zero1->zero0": (["--mesh", "dp=2,tp=2", "--zero", "1"], ["--mesh", "dp=2,tp=2"]),
    "zero0->zero1-selective": (
        ["--mesh", "dp=2,tp=2"],
        ["--mesh", "dp=2,tp=2", "--zero", "1", "--recompute", "selective"],
    ),
    # ZeRO-3 stores the parameters split as well; gradients are reduce-scattered in both.
    "zero3->zero2": (["--mesh", "dp=2,tp=2,pp=2", "--zero", "3"], ["--mesh", "dp=2,tp=2,pp=2", "--zero", "2"]),
    "dp4-zero1->dp4-full-recompute": (["--mesh", "dp=4", "--zero", "1"], ["--mesh", "dp=4", "--recompute", "full"]),
    # Under tp the recomputed block's input gradient is tp-partial; it is reduced where the
    # ordinary backward reduces it, so the sums keep their order.
    "tp-full-recompute": (["--mesh", "dp=2,tp=2"], ["--mesh", "dp=2,tp=2", "--recompute", "full"]),
    "tp-sp-zero2->full-recompute": (
        ["--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--zero", "2"],
        ["--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--zero", "2", "--recompute", "full"],
    ),
}


@pytest.mark.parametrize("case", list(KEEPS_REDUCTIONS))
def test_resume_under_another_zero_stage_is_bit_identical(tmp_path: Any, oracle: Oracle, case: str) -> None:
    before, after = KEEPS_REDUCTIONS[case]
    n = 8 if "pp=2" in before[1] else 4
    lines, series, final = oracle("sim", n, before)
    resumed = gpt("sim", n, "--steps", "5", *after, "--resume", f"{series}/step-2", "--save-final", str(tmp_path / "r"))
    assert resumed == lines[2:]
    assert_bit_identical(tmp_path / "r", final)


# =================================== mesh changes that reorder sums: 1e-12 in float64
REORDERS = {
    "dp4": (4, ["--mesh", "dp=4"]),
    "tp4": (4, ["--mesh", "tp=4"]),
    "dp2xtp2xpp2": (8, ["--mesh", "dp=2,tp=2,pp=2"]),
    "dp3-zero2-sp": (3, ["--mesh", "dp=3", "--zero", "2"]),
    "dp1-tp2-sp-full-recompute": (2, ["--mesh", "tp=2", "--sequence-parallel", "--recompute", "full"]),
}


def test_resume_on_another_mesh_matches_to_1e_12(tmp_path: Any) -> None:
    """Saved under dp2 x tp2 (ZeRO-1: states split over dp) at step 3, resumed on meshes whose
    sums run in another order: the continuation matches the uninterrupted dp2 x tp2 run, and
    the uninterrupted run on the new mesh, to 1e-12 (float64)."""
    source = ["--mesh", "dp=2,tp=2", "--zero", "1"]
    lines, series, final = uninterrupted(tmp_path, "sim", 4, source, steps=6, every=3, dtype="float64")
    for label, (n, mesh) in REORDERS.items():
        out = tmp_path / label
        resumed = gpt(
            "sim",
            n,
            "--steps",
            "6",
            "--dtype",
            "float64",
            *mesh,
            "--resume",
            f"{series}/step-3",
            "--save-final",
            str(out / "resumed"),
        )
        assert_losses_close(resumed, lines[3:])
        assert_close(out / "resumed", final)
        native = gpt("sim", n, "--steps", "6", "--dtype", "float64", *mesh, "--save-final", str(out / "native"))
        assert_losses_close(resumed, native[3:])
        assert_close(out / "resumed", out / "native")


# ====================================================== series, crashes, misuse
def test_resume_from_a_directory_skips_interrupted_saves_and_keep_last_prunes(tmp_path: Any) -> None:
    series = tmp_path / "series"
    lines = gpt(
        "sim", 2, "--steps", "4", "--mesh", "dp=2", "--save-every", "1", "--save-dir", str(series), "--keep-last", "2"
    )
    assert series_steps(series) == [3, 4]
    assert sorted(os.listdir(series)) == ["step-3", "step-4"]
    # A save of step 5 killed midway: a partial directory with data but no metadata.
    partial = series / f"step-5{PARTIAL_TAG}00000000deadbeef"
    partial.mkdir()
    (partial / "rank00000.safetensors").write_bytes(b"\0" * 64)
    assert resolve_checkpoint(series) == str(series / "step-4")
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*step-5\.partial-.* was interrupted"):
        resolve_checkpoint(partial)
    resumed = gpt("sim", 2, "--steps", "6", "--mesh", "dp=2", "--resume", str(series))
    full = gpt("sim", 2, "--steps", "6", "--mesh", "dp=2")
    assert lines == full[:4] and resumed == full[4:]


def test_nothing_to_resume_from_is_explained(tmp_path: Any) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"nothing to resume from .*empty: it is neither a checkpoint"):
        resolve_checkpoint(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*absent"):
        resolve_checkpoint(tmp_path / "absent")


def _tiny_gpt(par: GPTParallel | None, zero: int = 0) -> tuple[GPT, Any]:
    dist.seed(5)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8, dtype="float64"), par)
    opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    if zero:
        opt = dist.shard_optimizer(opt, [dist.ShardingStage1, dist.ShardingStage2, dist.ShardingStage3][zero - 1]("dp"))
    return model, opt


def _train(model: GPT, opt: Any, steps: int, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        rng = np.random.default_rng(i)
        x, y = (dist.to_tensor(rng.integers(0, 32, (4, 8))) for _ in range(2))
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def test_load_training_state_fills_optimizer_states_in_this_runs_layout_before_its_first_step(tmp_path: Any) -> None:
    """In-process: saved under dp2 x tp2 with ZeRO-2, restored under tp2 x dp2 with ZeRO-1 before
    any step; the states land in the new optimizer's ZeRO layout and the run continues exactly."""
    model, opt = _tiny_gpt(GPTParallel.from_degrees(2, 2), zero=2)
    _train(model, opt, 2)
    save_training_state(tmp_path / "ck", model=model, optimizer=opt, step=2, extra={"note": "x"})
    dist.set_rng_state({"seed": 0, "draws": 0})
    want = _train(model, opt, 2, start=2)

    par = GPTParallel([dist.ProcessMesh([[0, 2], [1, 3]], dim_names=["dp", "tp"])])
    model2, opt2 = _tiny_gpt(par, zero=1)
    resumed = load_training_state(tmp_path / "ck", model=model2, optimizer=opt2)
    assert (resumed.step, resumed.extra) == (2, {"note": "x"})
    states = opt2.state_tensors()
    assert len(states) == 2 * len(model2.parameters())
    for p in model2.parameters():
        layout = opt2.layout_of(p)
        for n in ("moment1", "moment2"):
            assert states[f"{p.name}.{n}"].spec == layout  # read straight into the ZeRO-1 split
    dist.set_rng_state({"seed": 0, "draws": 0})
    # tp splits the row-parallel sums the same way (2), dp too: the arithmetic is unchanged.
    assert _train(model2, opt2, 2, start=2) == want


def test_resume_restores_multi_precision_master_weights_and_float32_states(tmp_path: Any) -> None:
    """float16 parameters under AdamW(multi_precision=True) and ZeRO-1: the float32 moments and
    master copies are read into the dp split before the first step; the run continues exactly."""

    def build() -> tuple[Any, Any, dist.ProcessMesh]:
        dist.seed(7)
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        with default_dtype("float16"):
            lin = dist.nn.Linear(8, 6)
        dist.shard_layer(lin, mesh)
        opt = dist.optimizer.AdamW(learning_rate=1e-3, parameters=lin.parameters(), multi_precision=True)
        return lin, dist.shard_optimizer(opt, dist.ShardingStage1("dp")), mesh

    def train(lin: Any, opt: Any, mesh: dist.ProcessMesh, start: int) -> dict[str, np.ndarray]:
        for i in range(start, start + 2):
            x = np.random.default_rng(i).standard_normal((4, 8)).astype(np.float16)
            dist.mean(dist.square(lin(dist.shard_tensor(x, mesh, [dist.Shard(0)])))).backward()
            opt.step()
            opt.clear_grad()
        return {k: v.full_tensor() for k, v in [*lin.state_dict().items(), *opt.state_tensors().items()]}

    lin, opt, mesh = build()
    train(lin, opt, mesh, 0)
    save_training_state(tmp_path / "ck", model=lin, optimizer=opt, step=2)
    want = train(lin, opt, mesh, 2)
    lin2, opt2, mesh2 = build()
    load_training_state(tmp_path / "ck", model=lin2, optimizer=opt2)
    for p in lin2.parameters():
        master = opt2.state_tensors()[f"{p.name}.master_weight"]
        assert master.dtype == np.float32 and master.spec == opt2.layout_of(p)
    got = train(lin2, opt2, mesh2, 2)
    assert got.keys() == want.keys() and any(k.endswith("master_weight") for k in want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].tobytes() == w.tobytes(), k


def test_resume_refuses_a_checkpoint_of_another_model_or_kind(tmp_path: Any) -> None:
    model, opt = _tiny_gpt(None)
    _train(model, opt, 1)
    save_training_state(tmp_path / "ck", model=model, optimizer=opt, step=1)
    other = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=8, dtype="float64"))
    other_opt = dist.optimizer.AdamW(parameters=other.parameters())
    with pytest.raises(CheckpointError, match=r"has no entry 'model.blocks.2.ln1.weight'"):
        load_training_state(tmp_path / "ck", model=other, optimizer=other_opt)
    smaller = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8, dtype="float64"))
    with pytest.raises(CheckpointError, match=r"model entries this model does not have: \['blocks.1"):
        load_training_state(
            tmp_path / "ck", model=smaller, optimizer=dist.optimizer.AdamW(parameters=smaller.parameters())
        )
    momentum = dist.optimizer.Momentum(parameters=model.parameters())
    with pytest.raises(
        CheckpointError, match=r"optimizer tensors .*moment1.* not keep \(Momentum: \['velocity'\] per parameter\)"
    ):
        load_training_state(tmp_path / "ck", model=model, optimizer=momentum)
    dist.save_state_dict({"model": model.state_dict()}, tmp_path / "plain")
    with pytest.raises(
        CheckpointError, match=r"not a training checkpoint: it has no \['optimizer', 'step', 'rng', 'loader'\]"
    ):
        load_training_state(tmp_path / "plain", model=model, optimizer=opt)
    loader = dist.io.DataLoader(dist.io.Dataset(), batch_sampler=dist.io.RandomBatchSampler(10, 2))
    with pytest.raises(CheckpointError, match="holds no data-loader position"):
        load_training_state(tmp_path / "ck", model=model, optimizer=opt, loader=loader)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--save-every", "2"], "--save-every needs --save-dir DIR"),
        (["--save-dir", "x"], "--save-dir and --keep-last take effect with --save-every N"),
        (["--save-every", "-1", "--save-dir", "x"], r"--save-every \(-1\) and --keep-last \(0\) must be >= 0"),
    ],
)
def test_gpt_checkpoint_flag_misuse_is_refused(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, GPT_PY, "--tiny", "--steps", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=_env(),
    )
    assert proc.returncode != 0 and re.search(message, proc.stderr), proc.stderr


# ======================================================= optimizer.set_state_dict
def test_set_state_dict_before_the_first_step_takes_any_layout_dense_or_numpy() -> None:
    """The states restored before a step are the ones the step updates (lazy creation does not
    replace them), whatever form they come in."""
    model, opt = _tiny_gpt(GPTParallel.from_degrees(2, 2), zero=1)
    _train(model, opt, 2)
    saved = opt.state_dict()
    want = _train(model, opt, 1, start=2)
    forms = {
        "as saved": lambda t: t,
        "replicated": lambda t: dist.reshard(t, t.process_mesh, [dist.Replicate(), dist.Replicate()]),
        "dense": lambda t: dist.to_tensor(t.full_tensor()),
        "numpy": lambda t: t.full_tensor(),
    }
    for label, form in forms.items():
        model2, opt2 = _tiny_gpt(GPTParallel.from_degrees(2, 2), zero=1)
        # the parameters as they were at step 2
        _train(model2, opt2, 2)
        fresh = dist.optimizer.AdamW(learning_rate=1e-2, parameters=model2.parameters())
        fresh = dist.shard_optimizer(fresh, dist.ShardingStage1("dp"))
        fresh.set_state_dict({k: form(v) if isinstance(v, dist.Tensor) else v for k, v in saved.items()})
        for p in model2.parameters():
            assert fresh.state_tensors()[f"{p.name}.moment1"].spec == fresh.layout_of(p), label
        assert _train(model2, fresh, 1, start=2) == want, label


def test_set_state_dict_errors_name_the_state_and_the_fix() -> None:
    model, opt = _tiny_gpt(None)
    _train(model, opt, 1)
    saved = opt.state_dict()
    name = next(iter(saved["steps"]))
    with pytest.raises(
        ValueError, match=rf"no '{re.escape(name)}.moment2', though state\['steps'\] names its parameter"
    ):
        opt.set_state_dict({k: v for k, v in saved.items() if k != f"{name}.moment2"})
    wrong = dict(saved)
    wrong[f"{name}.moment1"] = np.zeros((3, 3))
    with pytest.raises(
        ValueError, match=rf"'{re.escape(name)}.moment1' is float64\[3, 3\], but its parameter .* is float64"
    ):
        opt.set_state_dict(wrong)
    wrong[f"{name}.moment1"] = [0.0]
    with pytest.raises(TypeError, match=r"is a list; give a Tensor or a NumPy array"):
        opt.set_state_dict(wrong)


# ============================================================================ MPI
@pytest.mark.mpi
def test_mpi_resume_is_bit_identical_and_interchangeable_with_the_simulator(tmp_path: Any) -> None:
    """Under mpiexec -n 4: an uninterrupted run equals the simulator's bit for bit; resuming it
    (same mesh, and ZeRO-2 -> ZeRO-3) is bit-identical; its checkpoint resumes in the
    simulator and a simulator checkpoint resumes under MPI, bit-identical again."""
    mesh = ["--mesh", "dp=2,tp=2", "--zero", "2"]
    lines, series, final = uninterrupted(tmp_path / "mpi", "mpi", 4, mesh)
    sim_lines, sim_series, sim_final = uninterrupted(tmp_path / "sim", "sim", 4, mesh)
    assert lines == sim_lines
    assert_bit_identical(final, sim_final)
    with open(os.path.join(series, "step-2", METADATA)) as f, open(os.path.join(sim_series, "step-2", METADATA)) as g:
        assert json.load(f)["tensors"] == json.load(g)["tensors"]  # same chunks, same CRCs
    runs = {
        "mpi same mesh": ("mpi", mesh, series),
        "mpi zero3": ("mpi", ["--mesh", "dp=2,tp=2", "--zero", "3"], series),
        "mpi -> sim": ("sim", mesh, series),
        "sim -> mpi": ("mpi", mesh, sim_series),
    }
    for label, (launch, args, source) in runs.items():
        out = tmp_path / label.replace(" ", "_").replace(">", "")
        resumed = gpt(launch, 4, "--steps", "5", *args, "--resume", f"{source}/step-2", "--save-final", str(out))
        assert resumed == lines[2:], label
        assert_bit_identical(out, final)


@pytest.mark.mpi
def test_mpi_resume_on_another_world_size_matches_to_1e_12(tmp_path: Any) -> None:
    """Saved by 4 MPI processes (dp2 x tp2, ZeRO-1), resumed by 8 (dp2 x tp2 x pp2, ZeRO-3)
    and by 2 (tp2, sequence parallel): float64, within 1e-12 of the uninterrupted run."""
    source = ["--mesh", "dp=2,tp=2", "--zero", "1"]
    lines, series, final = uninterrupted(tmp_path, "mpi", 4, source, steps=6, every=3, dtype="float64")
    for n, mesh in [(8, ["--mesh", "dp=2,tp=2,pp=2", "--zero", "3"]), (2, ["--mesh", "tp=2", "--sequence-parallel"])]:
        out = tmp_path / f"n{n}"
        resumed = gpt(
            "mpi",
            n,
            "--steps",
            "6",
            "--dtype",
            "float64",
            *mesh,
            "--resume",
            f"{series}/step-3",
            "--save-final",
            str(out),
        )
        assert_losses_close(resumed, lines[3:])
        assert_close(out, final)
