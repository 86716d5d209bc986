"""The examples written in the seeds' spelling keep the seed's lines and print one device's losses.

Each such example is a seed block with only its imports rewritten; around it, the shared flags,
seeding, the sizes the flags shrink and the ``step <n> loss <v>`` line. Here: every line of the
seed block is in the example, in order (the only edits: a size literal replaced by the name the
flags set), and every other line is one of the few kinds an example may add; and the examples run
(float64, ``--tiny``, 3 steps): seed 003's fleet data-parallel, group-sharded and model-parallel
programs, its semi-automatic data, model and pipeline programs (the primer's) and its to_static
programs print the single-card program's losses (§2.1.1, ``single.py``), seed 000 §4.5 prints one
device's, seed 000 §3 computes ``relu(A @ B)``. A fragment (seed 000 §4.2, §4.3: a model class)
sits in the program its text assumes, and the example's other lines are that program's.
``test_examples.py`` runs seed 000 §4.1-4.4 against ``--reference``. ``tests/mpi`` runs them
under ``mpiexec``.
"""

from __future__ import annotations

import os
import re

import pytest
from conftest import REPO
from mpi_scripts import seed_ports
from processes import environ, run_python

if not seed_ports.SEEDS.is_dir():
    pytest.skip(f"the seed files are not at {seed_ports.SEEDS} (set MPIPAR_SEEDS)", allow_module_level=True)

LOSS = re.compile(r"^step (\d+) loss (\S+)", re.M)
FLAGS = ["--tiny", "--dtype", "float64", "--steps", "3"]

# example -> the seed blocks it keeps (a leading "..." of a continuing block stands for the
# first block's program up to its training loop)
SEED_EXAMPLES: dict[str, list[str]] = {
    "basics/principle.py": ["000-02"],
    "paddle_auto/dp.py": ["000-03"],
    "paddle_auto/tp.py": ["000-04"],
    "paddle_auto/pp.py": ["000-05"],
    "paddle_auto/hybrid.py": ["000-06"],
    "paddle_auto/to_static_hybrid.py": ["000-06", "000-07"],
    "paddle_auto/single.py": ["003-00"],
    "paddle_auto/static_single.py": ["003-01"],
    "paddle_manual/dp.py": ["003-02"],
    "paddle_manual/sharding.py": ["003-03"],
    "paddle_manual/mp.py": ["003-04"],
    "paddle_manual/pp.py": ["003-05"],
    "paddle_auto/primer_dp.py": ["003-06"],
    "paddle_auto/primer_mp.py": ["003-07"],
    "paddle_auto/primer_pp.py": ["003-08"],
    "paddle_auto/to_static_dp.py": ["003-10"],
    "paddle_auto/to_static_mp.py": ["003-11"],
    "paddle_auto/to_static_pp.py": ["003-12"],
    "paddle_auto/engine_dp.py": ["003-14"],
    "paddle_auto/engine_sharding.py": ["003-15"],
    "paddle_auto/engine_mp.py": ["003-16"],
    "paddle_auto/engine_pp.py": ["003-17"],
}
# A fragment (seed 000 §4.2 and §4.3: a mesh and a model class) sits in the program its text
# assumes (§4.1's imports, data and loop): the example's other lines are that program's, in order.
HOSTS: dict[str, str] = {"000-04": "000-03", "000-05": "000-03"}
# A size literal the flags shrink, written as the name they set (the line is otherwise the seed's).
SIZE_NAMES = [
    ("inner_size=inner_size", "inner_size=102400"),
    ("shape=[HIDDEN, INNER]", "shape=[1024, 4096]"),
    ("shape=[INNER, HIDDEN]", "shape=[4096, 1024]"),
    ("RandomDataset(SEQ, HIDDEN)", "RandomDataset(128, 1024)"),
]
# What an example may add around the seed's lines (after its docstring and comment header).
ADDED = re.compile(
    r"\s*("
    r"|#.*|import _examples_path.*|from (paddle_common|common) import .*|args = seed_args\(__doc__(, pipeline=True)?\)"
    r"|require_world\(.*\)|log_step = StepLog\(\)|global_step = 0|global global_step|global_step \+= 1"
    r"|epoch, batch_num, inner_size = shrink\(.*\)|SEQ, HIDDEN, INNER = .*|log_step\(.*\)"
    r"|if args\.steps and step \+ 1 >= args\.steps:|break|if args\.schedule:|run_scheduled\(.*\)"
    r"|Matmul = paddle\.matmul|relu = paddle\.nn\.functional\.relu"
    r"|for rank in dist_tensorD\.hosted_ranks:|print\(f?\"D:.*\)"
    r")"
)


def seed_lines(names: list[str]) -> list[str]:
    blocks = {b.name: b for b in seed_ports.blocks()}
    lines: list[str] = []
    for name in names:
        block = seed_ports.rewrite_imports(blocks[name].source).splitlines()
        if block and block[0] == "...":  # continues the previous block's program, minus its loop
            lines = lines[: max(i for i, ln in enumerate(lines) if ln.startswith("for "))]
            block = block[1:]
        lines += block
    return lines


@pytest.mark.parametrize("example", sorted(SEED_EXAMPLES))
def test_the_example_keeps_the_seeds_lines(example: str) -> None:
    with open(os.path.join(REPO, "examples", example), encoding="utf-8") as f:
        text = f.read()
    assert re.match(r'"""Seed 00\d §[\d.]+.*Run: .*python .*examples/' + re.escape(example), text), text[:300]
    have = text.splitlines()[1:]
    for name, literal in SIZE_NAMES:
        have = [ln.replace(name, literal) for ln in have]
    want = [ln for ln in seed_lines(SEED_EXAMPLES[example]) if ln.strip()]
    extra: list[str] = []
    i = 0
    for ln in have:
        if i < len(want) and ln == want[i]:
            i += 1
        elif ln.strip():
            extra.append(ln)
    assert i == len(want), f"{example}: the seed's line {want[i]!r} is missing or out of order"
    host = SEED_EXAMPLES[example][-1]
    if host in HOSTS:  # the fragment's program: its lines, in order, among the rest
        rest = [ln for ln in seed_lines([HOSTS[host]]) if ln.strip()]
        j = 0
        for ln in extra:
            if ln in rest[j:]:
                j += rest[j:].index(ln) + 1
            elif not ADDED.fullmatch(ln):
                raise AssertionError(f"{example}: {ln!r} is neither {host}'s nor, in order, {HOSTS[host]}'s")
        return
    assert not [ln for ln in extra if not ADDED.fullmatch(ln)], f"{example}: lines that are not the seed's"


def run(*args: str) -> str:
    out = run_python(*args, env=environ(drop_prefix="MPIPAR_", one_thread=True))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def losses(stdout: str) -> list[float]:
    found = LOSS.findall(stdout)
    assert [int(s) for s, _ in found] == [0, 1, 2], stdout[-2000:]
    return [float(v) for _, v in found]


@pytest.fixture(scope="module")
def single_card() -> list[float]:
    """Seed 003 §2.1.1 on one device: the losses every seed 003 program is held to."""
    return losses(run("examples/paddle_auto/single.py", *FLAGS))


@pytest.mark.parametrize(
    "script",
    [
        "paddle_manual/dp.py", "paddle_manual/sharding.py", "paddle_manual/mp.py",
        *[f"paddle_auto/primer_{k}.py" for k in ("dp", "mp", "pp")],
        *[f"paddle_auto/to_static_{k}.py" for k in ("dp", "mp", "pp")],
    ],
)  # fmt: skip
def test_seed_003_programs_print_the_single_card_losses(script: str, single_card: list[float]) -> None:
    """Every rank seeds NumPy alike and draws the same batches, so data parallelism (fleet's,
    group-sharded's) averages equal gradients and model parallelism splits one net: one device's
    losses. The fleet programs run one program per rank (each with its own NumPy generator)."""
    out = run("-m", "simulator", "-n", "2", f"examples/{script}", *FLAGS)
    for a, b in zip(losses(out), single_card, strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (script, losses(out), single_card)
    assert re.search(r"^\[Epoch 0, batch 0\] loss: \d\.\d{5}", out, re.M)  # the seed's own print


def test_seed_003_fleet_pipeline_trains(single_card: list[float]) -> None:
    """PipelineLayer builds each stage's layers on its own rank, so the initial weights (and the
    losses) are not the single-card program's, as in Paddle; both ranks print the same loss."""
    out = run("-m", "simulator", "-n", "2", "examples/paddle_manual/pp.py", *FLAGS)
    got = losses(out)
    assert all(0.0 < v < 10.0 for v in got) and got != single_card
    ranks = re.findall(r"^(?:\[rank 1\] )?\[Epoch 0, batch 0\] loss: (\S+)$", out, re.M)
    assert len(ranks) == 2 and ranks[0] == ranks[1], out[-2000:]


def test_seed_000_to_static_hybrid_prints_one_devices_losses() -> None:
    path = "examples/paddle_auto/to_static_hybrid.py"
    one = losses(run("-m", "simulator", "--reference", path, *FLAGS))
    eight = losses(run("-m", "simulator", "-n", "8", path, *FLAGS))
    for a, b in zip(eight, one, strict=True):
        assert abs(a - b) <= 1e-9 * abs(b), (eight, one)


def test_seed_000_principle_computes_relu_of_a_times_b() -> None:
    out = run("-m", "simulator", "-n", "2", "examples/basics/principle.py")
    # A = [[1, 2], [3, 4]] replicated, B = [[5, 6], [7, 8]] split by rows: D = relu(A @ B), replicated
    assert out.splitlines()[-1] == "D: [[19, 22], [43, 50]]"
    assert "D: rank 0: [Replicate()] [[19, 22], [43, 50]]" in out and "D: rank 1: [Replicate()]" in out
