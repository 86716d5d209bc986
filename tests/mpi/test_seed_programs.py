"""The seeds' programs run after the import rewrite alone, taken from the seed files themselves.

``tests/mpi_scripts/seed_ports.py`` extracts every Python block of the four seeds and ports it mechanically (imports,
sizes, a fragment's marked lines). Here: the ports differ from the seed only there; every block
this tree owns runs in the simulator and under ``mpiexec`` (one launch per world size, each
running many blocks in turn); the training blocks print the single-card program's losses (seed
003 §2.1.1, run the same way); and the communication the seeds describe happens, counted by
``CommDebugMode`` under MPI: data parallelism all-reduces gradients, ZeRO-3 gathers parameters.
The static-graph and Engine blocks (``seed_ports.STATIC_BLOCKS``) join once ``mpipar.enable_static``
and ``mpipar.distributed.Engine`` exist.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO
from mpi_scripts import seed_ports
from mpi_scripts.launch import mpirun

if not seed_ports.SEEDS.is_dir():
    pytest.skip(f"the seed files are not at {seed_ports.SEEDS} (set MPIPAR_SEEDS)", allow_module_level=True)

ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
LOSS = re.compile(r"^\[Epoch (\d+), batch (\d+)\] loss: (\S+?),?(?: |$)", re.M)
WIDE = [b.name for b in seed_ports.runnable() if seed_ports.world_of(b) > 2]  # seed 000's meshes of 4-8
NARROW = [b.name for b in seed_ports.runnable() if seed_ports.world_of(b) <= 2]
SINGLE_CARD = "003-00"
# Seed 003's semi-automatic programs (dynamic and to_static) train the single-card net on the same
# data (every rank reads the whole batch), so they print its losses exactly.
SAME_AS_SINGLE_CARD = ["003-06", "003-07", "003-08", "003-10", "003-11", "003-12"]
if seed_ports.static_available():  # the static single-card program and the Engine's (its pipeline,
    # 003-17, prints on the last stage's rank only: it runs, rank 0 has no loss to compare)
    SAME_AS_SINGLE_CARD += sorted(seed_ports.STATIC_BLOCKS - {"003-17"})


def sections(output: str) -> dict[str, str]:
    """Rank 0's output of each block (``=== NAME`` markers; other ranks' lines are tagged)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("[rank "):
            continue
        if line.startswith("=== "):
            current = line[4:].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def losses(text: str) -> list[tuple[str, str, str]]:
    return LOSS.findall(text)


def simulate(names: list[str], n: int, per_rank: bool, tmp: str) -> str:
    mode = ["--per-rank"] if per_rank else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIPAR_")}
    proc = subprocess.run(
        [sys.executable, "-m", "simulator", "-n", str(n), *mode, "tests/mpi_scripts/seed_ports.py", "--out", tmp, "--run", *names],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=REPO, env={**env, **ENV},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_the_seeds_hold_29_programs_and_2_placeholders() -> None:
    blocks = seed_ports.blocks()
    assert len([b for b in blocks if not seed_ports.is_placeholder(b)]) == 29
    assert [b.heading.split()[0] for b in blocks if seed_ports.is_placeholder(b)] == ["2.2.4.2.4", "2.2.4.2.8"]
    assert {b.name for b in blocks} >= seed_ports.STATIC_BLOCKS
    # Every program block is run here, or owned by the static graph's work until it lands.
    assert set(WIDE) | set(NARROW) | seed_ports.STATIC_BLOCKS == {
        b.name for b in blocks if not seed_ports.is_placeholder(b)
    }


@pytest.mark.parametrize(
    "block", [b for b in seed_ports.blocks() if not seed_ports.is_placeholder(b)], ids=lambda b: b.name
)
def test_a_port_changes_only_imports_sizes_and_marked_lines(block: seed_ports.Block) -> None:
    ported = [ln for ln in seed_ports.port(block).splitlines() if not ln.endswith(seed_ports.PORT_MARK)]
    frag = seed_ports.FRAGMENTS.get(block.name)
    if frag is not None and frag.prefix_block is not None:  # the continued block's lines come first
        ported = ported[len([ln for ln in seed_ports.port(next(b for b in seed_ports.blocks() if b.name == frag.prefix_block), seed_rng=False).splitlines() if not ln.endswith(seed_ports.PORT_MARK)]) :]  # fmt: skip
    original = block.source.splitlines()
    assert len(ported) == len(original)
    shrinks = seed_ports.SHRINK[block.seed]
    typos = seed_ports.TYPO_FIXES.get(block.name, [])
    for a, b in zip(original, ported, strict=True):
        if a == b:
            continue
        if a.lstrip().startswith(("import ", "from ")):
            assert "mpipar" in b and b.replace("mpipar", "paddle").replace("from paddle import oneflow as flow", "import oneflow as flow").replace("import paddle as paddle", "import paddle") == a, (a, b)  # fmt: skip
            continue
        undone = b
        for old, new in shrinks:
            undone = re.sub(rf"(?<![\w.]){re.escape(new)}(?![\w.])", old, undone)
        for old, new in typos:
            undone = undone.replace(new, old)
        assert undone == a or any(old in a for old, _ in shrinks), "\n".join(difflib.ndiff([a], [b]))


@pytest.fixture(scope="module")
def sim_narrow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return sections(simulate(NARROW, 2, True, str(tmp_path_factory.mktemp("narrow"))))


@pytest.fixture(scope="module")
def sim_wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return sections(simulate(WIDE, 8, False, str(tmp_path_factory.mktemp("wide"))))


@pytest.fixture(scope="module")
def mpi_narrow(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    run = mpirun(2, "tests/mpi_scripts/seed_ports.py", "--out", str(tmp_path_factory.mktemp("mn")), "--run", *NARROW, env=ENV, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    return split_comm(run.output)


@pytest.fixture(scope="module")
def mpi_wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    run = mpirun(8, "tests/mpi_scripts/seed_ports.py", "--out", str(tmp_path_factory.mktemp("mw")), "--run", *WIDE, env=ENV, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.output[-4000:]
    return split_comm(run.output)


def split_comm(output: str) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    comm = {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^comm (\S+) (\{.*\})$", output, re.M)}
    return sections(re.sub(r"^comm .*$", "", output, flags=re.M)), comm


def test_every_block_runs_in_the_simulator(sim_narrow: dict[str, str], sim_wide: dict[str, str]) -> None:
    assert set(sim_narrow) == set(NARROW) and set(sim_wide) == set(WIDE)
    assert "[4, 3]" in sim_narrow["002-03"]  # OneFlow's two-stage pipeline reached its last print


def test_every_block_runs_under_mpiexec(mpi_narrow: tuple, mpi_wide: tuple) -> None:
    assert set(mpi_narrow[0]) == set(NARROW) and set(mpi_wide[0]) == set(WIDE)


def test_semi_automatic_programs_print_the_single_card_losses(sim_narrow: dict[str, str], mpi_narrow: tuple) -> None:
    want = losses(sim_narrow[SINGLE_CARD])
    assert len(want) == 4  # 2 epochs, batches 0 and 5
    for name in SAME_AS_SINGLE_CARD:
        assert losses(sim_narrow[name]) == want, name
        assert losses(mpi_narrow[0][name]) == want, name
    assert losses(mpi_narrow[0][SINGLE_CARD]) == want


def test_the_communication_the_seeds_describe_happens(mpi_narrow: tuple, mpi_wide: tuple) -> None:
    comm = {**mpi_narrow[1], **mpi_wide[1]}
    # 192 samples, a global batch of 64 over 2 ranks: 3 steps an epoch, 2 epochs.
    steps, params = 6, 6
    assert comm["003-02"] == {"all_reduce": steps}  # fleet data parallel: one fused gradient bucket a step
    # group_sharded p_g_os (ZeRO-3): each forward gathers every parameter from its owner; each
    # gradient is reduced to its owner only.
    assert comm["003-03"] == {"broadcast": steps * params, "reduce": steps * params}
    assert comm["003-04"]["all_reduce"] >= steps and comm["003-04"]["broadcast"] == steps  # mp inputs broadcast
    assert comm["003-05"]["send"] > 0  # the pipeline's stages exchange activations and gradients
    assert comm["003-06"]["all_reduce"] >= 12 * params  # semi-automatic data parallel: gradients all-reduced
    assert comm["000-03"]["all_reduce"] >= 1  # seed 000 §4.1 marks its batch: gradients are all-reduced
    assert comm["000-06"]["send"] > 0 and comm["000-06"]["all_reduce"] > 0
    assert comm["001-00"] == {
        "all_reduce": 1,
        "broadcast": 2,
    }  # sharding_degree 2 from distributed_optimizer's strategy
