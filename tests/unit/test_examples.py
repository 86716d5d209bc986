"""Every example: ``--reference`` and ``python -m simulator -n N`` print the same losses.

float64, ``--tiny``, 3 steps, 1e-9 relative. Also the examples' misuse
errors: wrong world size, mesh degrees whose product is wrong, indivisible batches. The examples
in the seeds' spelling (``paddle_manual/``: fleet programs, which need their ranks; the
``to_static`` and ``Engine`` ones, seed 003's semi-automatic primer programs, held to the
single-card program's losses) are tested in test_seed_examples.py and test_paddle_auto_examples.py.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from processes import environ, run_python

LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)

CASES = [
    ("paddle_auto/dp.py", [], 8),
    ("paddle_auto/tp.py", [], 8),
    ("paddle_auto/pp.py", [], 8),
    ("paddle_auto/hybrid.py", [], 8),
    ("paddle_auto/primer_sharding.py", ["--stage", "1"], 8),
    ("paddle_auto/primer_sharding.py", ["--stage", "2"], 8),
    ("paddle_auto/primer_sharding.py", ["--stage", "3"], 8),
    ("oneflow/data.py", [], 2),
    ("oneflow/model.py", [], 2),
    ("oneflow/pipeline.py", [], 2),
    ("oneflow/hybrid.py", [], 8),
    ("gpt.py", ["--mesh", "dp=8"], 8),
    ("gpt.py", ["--mesh", "tp=8"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=4", "--sequence-parallel"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "1"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "2"], 8),
    ("gpt.py", ["--mesh", "dp=8", "--zero", "3"], 8),
    ("gpt.py", ["--mesh", "dp=4,tp=2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2,pp=2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2,pp=2", "--sequence-parallel", "--recompute", "full", "--zero", "2"], 8),
    ("gpt.py", ["--mesh", "dp=2,tp=2", "--recompute", "selective", "--accumulate-steps", "2"], 4),
    ("gpt.py", ["--mesh", "dp=2,cp=2,tp=2", "--attention", "fused"], 8),
    ("llama.py", ["--mesh", "dp=2,cp=2,tp=2", "--sequence-parallel"], 8),
    ("llama.py", ["--mesh", "cp=4", "--cp-comm", "ring"], 4),
    ("llama.py", ["--mesh", "tp=2,pp=2", "--schedule", "1F1B", "--attention", "plain"], 4),
]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return run_python(*args, env=environ(drop=("MPIPAR_BACKEND", "MPIPAR_TRACE")), timeout=timeout)


def losses(out: subprocess.CompletedProcess[str]) -> list[float]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [float(v) for _, v in LOSS.findall(out.stdout)]


@pytest.mark.parametrize(("script", "extra", "n"), CASES, ids=[f"{s[:-3]}{''.join(e)}" for s, e, _ in CASES])
def test_reference_and_virtual_ranks_print_the_same_losses(script: str, extra: list[str], n: int) -> None:
    path = os.path.join("examples", script)
    common = ["--tiny", "--dtype", "float64", "--steps", "3", *extra]
    ref = losses(run("-m", "simulator", "--reference", path, *common))
    sim = losses(run("-m", "simulator", "-n", str(n), path, *common))
    assert len(ref) == 3 and len(sim) == 3
    for a, b in zip(ref, sim, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a), (ref, sim)


def test_gpt_degrees_must_multiply_to_the_world() -> None:
    out = run("-m", "simulator", "-n", "8", "examples/gpt.py", "--tiny", "--steps", "1", "--mesh", "dp=2,tp=2")
    assert out.returncode != 0
    assert "dp(2) * tp(2) * pp(1) * cp(1) = 4 != world size 8" in out.stderr


def test_a_world_too_small_for_the_meshes_is_refused() -> None:
    out = run("-m", "simulator", "-n", "4", "examples/paddle_auto/hybrid.py", "--tiny", "--steps", "1")
    assert out.returncode != 0
    assert "names process 4, but the world has 4 ranks" in out.stderr or "needs 8 ranks" in out.stderr


def test_gpt_micro_batches_must_divide_the_batch() -> None:
    out = run("examples/gpt.py", "--tiny", "--steps", "1", "--batch-size", "7", "--accumulate-steps", "2")
    assert out.returncode != 0
    assert "--batch-size 7 is not divisible by --accumulate-steps 2" in out.stderr


def test_float32_runs_agree_to_float32_precision() -> None:
    common = ["examples/gpt.py", "--tiny", "--steps", "3", "--mesh", "dp=2,tp=2", "--dtype", "float32"]
    ref = losses(run("-m", "simulator", "--reference", *common))
    sim = losses(run("-m", "simulator", "-n", "4", *common))
    for a, b in zip(ref, sim, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (ref, sim)


def test_gpt_first_run_uses_the_whole_world_and_explains_itself() -> None:
    """No --mesh under -n 8: data parallel over 8 ranks, the same losses and sample as one device."""
    common = ["examples/gpt.py", "--tiny", "--steps", "3", "--sample", "12", "--dtype", "float64"]
    sim = run("-m", "simulator", "-n", "8", *common)
    ref = run("-m", "simulator", "--reference", *common)
    explicit = run("-m", "simulator", "-n", "8", *common, "--mesh", "dp=8")
    assert sim.returncode == 0 and ref.returncode == 0 and explicit.returncode == 0, (
        sim.stderr + ref.stderr + explicit.stderr
    )
    lines = sim.stdout.splitlines()
    assert re.fullmatch(
        r"GPT: [\d,]+ parameters \| mesh dp=8 \(8 ranks\) \| batch 8 x 16 tokens = 128 tokens/step", lines[0]
    )
    assert lines[1].startswith("data: 50,000 characters of the Python standard library's .py files")
    assert [int(s) for s, _ in LOSS.findall(sim.stdout)] == [0, 1, 2]
    assert losses(sim) == losses(explicit)
    for a, b in zip(losses(ref), losses(sim), strict=True):
        assert abs(a - b) <= 1e-9 * abs(a)
    assert re.search(r"^trained 3 steps in [\d.]+ s: [\d.]+ ms/step, [\d,]+ tokens/s$", sim.stdout, re.M)
    assert lines[-2] == "sample (greedy, after the first 16 characters of the data):"
    prompt, _, text = lines[-1].partition("|")
    assert prompt == '"""Record of pha' and len(text.encode().decode("unicode_escape")) == 12
    assert (
        sim.stdout.splitlines()[-1] == ref.stdout.splitlines()[-1]
    )  # the trained model writes what one device's writes
    # Per-step speed goes to stderr when stdout is not a terminal (stdout stays the parseable loss log).
    assert re.findall(r"^step (\d+): [\d.]+ ms/step, [\d,]+ tokens/s$", sim.stderr, re.M) == ["0", "1", "2"]
    # The closing spread of step times, on stderr (stdout keeps the loss log): the one step after
    # two warm-up steps is too few for percentiles, so none is printed here; five steps give one.
    assert "p90/p50" not in sim.stdout + sim.stderr
    five = run("examples/gpt.py", "--tiny", "--steps", "5", "--sample", "0")
    assert five.returncode == 0, five.stderr[-2000:]
    assert "p90/p50" not in five.stdout
    assert re.search(
        r"^step time over 3 steps after 2 warm-up: p10 [\d.]+ ms, p50 [\d.]+ ms, p90 [\d.]+ ms, p90/p50 [\d.]+ ",
        five.stderr,
        re.M,
    ), five.stderr[-2000:]


def test_gpt_sample_count_must_not_be_negative() -> None:
    out = run("examples/gpt.py", "--tiny", "--steps", "1", "--sample", "-1")
    assert out.returncode != 0 and "--sample -1" in out.stderr


def test_llama_shape_flags_set_the_model_and_bad_shapes_are_named() -> None:
    from mpipar.models.llama import llama_config

    shape = ["--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn-hidden", "64", "--seq-len", "32"]
    out = run("examples/llama.py", "--tiny", "--steps", "1", "--sample", "0", *shape)
    assert out.returncode == 0, out.stderr[-2000:]
    want = llama_config(
        "tiny",
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_hidden_layers=2,
    ).num_parameters()
    assert re.match(rf"Llama: {want:,} parameters \| .* x 32 tokens", out.stdout), out.stdout[:300]
    bad = run("examples/llama.py", "--tiny", "--steps", "1", "--hidden", "30")
    assert bad.returncode != 0 and "hidden_size 30, 4 attention heads" in bad.stderr
