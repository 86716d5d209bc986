"""The seeds' program blocks, ported mechanically: the import rewrite and a size shrink, nothing else.

A Paddle or OneFlow user's first test of mpipar is to take a program they have and change its
imports. The seeds' ```python blocks are such programs, so this module takes them *from the seed
files*, not from hand copies:

* ``blocks()`` extracts every Python block of the four seeds (``/work/shared/seeds`` or
  ``$MPIPAR_SEEDS``), named by seed and section;
* ``port(block)`` applies only the import rewrite (``import paddle`` -> ``import mpipar as
  paddle``, ``paddle.distributed`` -> ``mpipar.distributed``, ``from paddle.X`` -> ``from
  mpipar.X``, ``import oneflow as flow`` -> ``from mpipar import oneflow as flow``), the size
  shrink of its seed (whole-word literal swaps: 102400 -> 64, ...), and for a fragment the few
  lines it assumes, each marked ``# [port]``;
* ``python tests/mpi_scripts/seed_ports.py --out DIR --run NAME...`` writes and runs ports in one process (the
  driver ``mpiexec`` launches once for many blocks).

Blocks that need the static graph or the ``Engine`` are listed in ``STATIC_BLOCKS``: they run as
soon as ``mpipar.enable_static`` / ``mpipar.distributed.Engine`` exist (``static_available()``).
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

SEEDS = Path(os.environ.get("MPIPAR_SEEDS", "/work/shared/seeds"))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)
RST = re.compile(r"^\.\. code-block:: python[ \t]*\n\n((?:(?:[ \t]+.*)?\n)+)", re.M)  # seed 001 is reStructuredText
HEADING = re.compile(r"^(#{1,6})\s+(.*)$", re.M)
PORT_MARK = "  # [port]"


@dataclass(frozen=True)
class Block:
    seed: str  # "000".."003"
    index: int  # 0-based position among the seed's Python blocks
    heading: str  # the nearest heading above the block
    source: str

    @property
    def name(self) -> str:
        return f"{self.seed}-{self.index:02d}"


def seed_files() -> dict[str, Path]:
    files = {p.name[:3]: p for p in sorted(SEEDS.glob("[0-9][0-9][0-9]_*.txt"))}
    if not files:
        raise FileNotFoundError(f"no seed files under {SEEDS} (set MPIPAR_SEEDS)")
    return files


def blocks() -> list[Block]:
    """Every ```python block of every seed, in order, with the heading it sits under."""
    out: list[Block] = []
    for seed, path in seed_files().items():
        text = path.read_text(encoding="utf-8")
        headings = [(m.start(), m.group(2).strip()) for m in HEADING.finditer(text)]
        found = [(m.start(), m.group(1)) for m in FENCE.finditer(text)]
        found += [(m.start(), textwrap.dedent(m.group(1))) for m in RST.finditer(text)]
        for i, (start, source) in enumerate(sorted(found)):
            above = [h for pos, h in headings if pos < start]
            out.append(Block(seed, i, above[-1] if above else "", source))
    return out


def is_placeholder(block: Block) -> bool:
    """Seed 003's "to be written" blocks (``# 后续完善``): nothing to run."""
    code = [ln for ln in block.source.splitlines() if ln.strip()]
    return all(ln.lstrip().startswith("#") for ln in code)


# --- the import rewrite (the only edit a user makes) ------------------------------------------

IMPORT_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^(\s*)import paddle\.distributed as (\w+)[ \t]*$", re.M), r"\1import mpipar.distributed as \2"),
    (re.compile(r"^(\s*)import paddle[ \t]*$", re.M), r"\1import mpipar as paddle"),
    (re.compile(r"^(\s*)import paddle as (\w+)[ \t]*$", re.M), r"\1import mpipar as \2"),
    (re.compile(r"^(\s*)from paddle(\.[\w.]+)? import ", re.M), r"\1from mpipar\2 import "),
    (re.compile(r"^(\s*)import oneflow as (\w+)[ \t]*$", re.M), r"\1from mpipar import oneflow as \2"),
]


def rewrite_imports(source: str) -> str:
    for pattern, repl in IMPORT_RULES:
        source = pattern.sub(repl, source)
    return source


# --- the size shrink (literals only, whole words) ---------------------------------------------

SHRINK: dict[str, list[tuple[str, str]]] = {
    # seed 000: (4, 128, 1024) batches, 1024 x 4096 weights, 100 samples
    "000": [("1024", "16"), ("4096", "32"), ("128", "4"), ("num_samples=100", "num_samples=8")],
    "001": [],
    "002": [],
    # seed 003: a 256 -> 102400 -> 256 -> 10 net, 5 epochs of 100 batches of 32
    "003": [("102400", "64"), ("epoch = 5", "epoch = 2"), ("batch_num = 100", "batch_num = 6")],
}


def shrink(seed: str, source: str) -> str:
    for old, new in SHRINK[seed]:
        source = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w.])", new, source)
    return source


# --- what a fragment assumes (marked lines) -----------------------------------------------------

PREAMBLE_PADDLE = ["import numpy as np", "import mpipar as paddle", "import mpipar.distributed as dist"]


RUN_MLP = [
    "model = MlpModel()",
    "x = paddle.to_tensor(np.random.uniform(size=[4, 4, 16]).astype('float32'))",
    "loss = paddle.mean(model(x))",
    "loss.backward()",
    "print('loss', float(loss))",
]
"""What seed 000 §4.2 and §4.3 (model classes only) assume: one step of §4.1's program."""


@dataclass(frozen=True)
class Fragment:
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    prefix_block: str | None = None  # run this (ported) block first: the fragment continues it


# A fragment's lines are the seed's; these marked lines supply what the seed's text says around it.
FRAGMENTS: dict[str, Fragment] = {
    # §3: Matmul and relu are the prose's names for the ops
    "000-02": Fragment(before=["Matmul = paddle.matmul", "relu = paddle.nn.functional.relu"]),
    # §4.2 / §4.3: the model classes of a program whose imports and loop are §4.1's
    "000-04": Fragment(
        before=PREAMBLE_PADDLE,
        after=RUN_MLP,
    ),
    "000-05": Fragment(
        before=PREAMBLE_PADDLE,
        after=RUN_MLP,
    ),
    # §4.5: continues §4.4's program (its model, dataloader and opt)
    "000-07": Fragment(prefix_block="000-06"),
    # seed 001: a fragment of a training script; args are its command line
    "001-00": Fragment(
        before=[
            "import argparse",
            "import numpy as np",
            "import mpipar as paddle",
            "from mpipar.distributed import fleet",
            "args = argparse.Namespace(use_sharding=True, num_pp=1, num_sharding=2, num_mp=1, num_dp=1)",
            "micro_bsz, acc_steps = 2, 1",
        ],
        after=[
            "model = paddle.nn.Linear(8, 4)",
            "optimizer = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())",
            "optimizer = fleet.distributed_optimizer(optimizer, strategy=dist_strategy)",
            "hcg = fleet.get_hybrid_communicate_group()",
            "print('sharding', hcg.get_sharding_parallel_world_size(), 'dp', hcg.get_data_parallel_world_size())",
            "x = paddle.to_tensor(np.random.uniform(size=[4, 8]).astype('float32'))",
            "loss = paddle.mean(model(x))",
            "loss.backward()",
            "optimizer.step()",
            "print('loss', float(loss))",
        ],
    ),
}

# seed 002's pipeline block writes ``flow,matmul(...)`` (a comma for a dot): a typo that no import
# rewrite can make run (OneFlow itself raises NameError on it). The port fixes that one character.
TYPO_FIXES: dict[str, list[tuple[str, str]]] = {"002-03": [("flow,matmul(", "flow.matmul(")]}

# Blocks whose programs are the static graph (paddle.enable_static, paddle.static.Executor) or the
# auto-parallel Engine: the static graph's work. They join the runs once that API exists.
STATIC_BLOCKS = frozenset({"003-01", "003-14", "003-15", "003-16", "003-17"})

# World size each block's program is written for (its meshes, or its fleet degrees).
WORLD: dict[str, int] = {
    "000-00": 6,
    "000-01": 4,
    "000-02": 2,
    "000-03": 4,
    "000-04": 4,
    "000-05": 8,
    "000-06": 8,
    "000-07": 8,
    "001-00": 2,
    "002-00": 1,
    "002-01": 2,
    "002-02": 2,
    "002-03": 2,
}


def world_of(block: Block) -> int:
    return WORLD.get(block.name, 1 if block.name in ("003-00", "003-01") else 2)


def static_available() -> bool:
    """Has this tree the static graph and the Engine (the static blocks then join the runs)?"""
    import importlib

    # importlib, not an import statement: the simulator reads this driver's imports to pick its mode.
    paddle, dist = importlib.import_module("mpipar"), importlib.import_module("mpipar.distributed")
    return hasattr(paddle, "enable_static") and hasattr(dist, "Engine")


def port(block: Block, *, seed_rng: bool = True) -> str:
    """The program a user gets by changing ``block``'s imports (sizes shrunk, fragments completed)."""
    source = block.source
    for old, new in TYPO_FIXES.get(block.name, []):
        if old not in source:
            raise ValueError(f"{block.name}: the typo {old!r} is no longer in the seed")
        source = source.replace(old, new)
    source = shrink(block.seed, rewrite_imports(source))
    frag = FRAGMENTS.get(block.name, Fragment())
    lines: list[str] = []
    if seed_rng:
        lines += ["import numpy as np" + PORT_MARK, "np.random.seed(2024)" + PORT_MARK]
    if frag.prefix_block is not None:
        prefix = next(b for b in blocks() if b.name == frag.prefix_block)
        lines += [ln for ln in port(prefix, seed_rng=False).splitlines()]
    body = source.splitlines()
    # The assumed lines go after the block's own imports (they may use them), else first.
    cut = 0
    for i, ln in enumerate(body):
        if ln.startswith(("import ", "from ")):
            cut = i + 1
        elif ln.strip() and not ln.startswith("#") and cut:
            break
    lines += body[:cut] + [ln + PORT_MARK for ln in frag.before] + body[cut:]
    lines += [ln + PORT_MARK for ln in frag.after]
    return "\n".join(lines) + "\n"


def runnable() -> list[Block]:
    """The blocks this tree must run: all but the placeholders, and the static ones until it has them."""
    static = static_available()
    return [b for b in blocks() if not is_placeholder(b) and (static or b.name not in STATIC_BLOCKS)]


def write_ports(out: Path, names: list[str] | None = None) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for b in blocks():
        if is_placeholder(b) or (names is not None and b.name not in names):
            continue
        path = out / f"seed_{b.name.replace('-', '_')}.py"
        path.write_text(port(b), encoding="utf-8")
        paths[b.name] = path
    return paths


def main(argv: list[str]) -> int:
    """``seed_ports.py --out DIR [NAME ...]``: write the ports; with ``--run`` also run them here in
    turn (one launch serves many blocks). Rank 0 prints ``=== NAME`` before each block; under MPI
    each block runs inside a ``CommDebugMode`` and rank 0 prints ``comm NAME {op: n}`` after it,
    and other ranks' output is dropped (the per-rank simulator tags it ``[rank r]`` itself)."""
    import argparse
    import contextlib
    import io
    import json
    import runpy

    import mpipar

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--run", action="store_true")
    p.add_argument("names", nargs="*")
    ns = p.parse_args(argv)
    paths = write_ports(Path(ns.out), ns.names or None)
    if not ns.run:
        for name, path in paths.items():
            print(name, path)
        return 0
    backend = mpipar.current_backend()
    mpi = backend.name == "mpi"
    fresh = mpipar.get_rng_state()  # each block starts from the generator a fresh process has
    for name in ns.names or list(paths):
        mpipar.set_rng_state(fresh)
        if not mpi or backend.rank == 0:
            print(f"=== {name}", flush=True)
        if not mpi:
            runpy.run_path(str(paths[name]), run_name="__main__")
            continue
        buf = io.StringIO()
        with mpipar.CommDebugMode() as mode, contextlib.redirect_stdout(buf):
            runpy.run_path(str(paths[name]), run_name="__main__")
        if backend.rank == 0:
            sys.stdout.write(buf.getvalue())
            print(f"comm {name} {json.dumps(dict(sorted(mode.counts().items())))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
