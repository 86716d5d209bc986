"""The eager step's framework work with cold caches, counted by a cache simulator: the same
figure on every run of the same code, whatever the machine's load.

    .venv/bin/python benchmarks/eager_cold_cost.py [--steps 5 25]

Under ``mpiexec -n 4`` on two cores the framework's Python costs four to five times what it
costs in a warm loop (``docs/performance.md``, "What remains"): each op's Python runs after a
matrix product or the other rank on the core has emptied the caches, so what an op costs is the
code and data it touches, not its bytecodes, and timings on a shared machine move by more than
one change saves. This benchmark counts that cost instead of timing it. It runs the TP MLP step
of ``tp_mlp_vs_mpi4py.py`` as rank 0 of 4 in one process (``eager_dispatch_cpu.py``'s backend;
batch 4, in 8, hidden 16: data too small to matter) under valgrind's cachegrind, with a 2 MiB
buffer streamed through the caches after every kernel, the optimizer's update and before each
step (what a matrix product at the benchmark's shapes does to a core's 1 MiB L2), and reports
per step, from the difference of a run of ``--steps`` A and one of B steps (start-up cancels):

* instructions (``Ir``), first-level misses (``I1``, ``D1``: 32 KiB) and misses of the
  simulated 1 MiB last level (``IL``, ``DL``: what then comes from L3 or memory), the
  streaming itself left out;
* ``estimate``: Ir + 10 x first-level misses + 60 x last-level misses, in cycles (a model, for
  comparing two versions of the code, not a prediction of seconds);
* the same for the hand-written NumPy step with a buffer streamed after each of its NumPy calls
  (the cold cost its kernels' own entry points pay), and the eager step's extra over it.

Needs valgrind (``apt-get install valgrind``); without it the benchmark says so and exits 1.
``--inner N --what eager|hand`` is the run valgrind watches (for this script only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EVICT_BYTES = 2 << 20
"""What is streamed through the caches after every kernel: twice the simulated last level."""
CACHES = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]
STREAMING = "DOUBLE_add"
"""The streaming's own inner loop (a float64 add over the buffer): left out of the counts."""
EVENTS = ("Ir", "I1mr", "ILmr", "Dr", "D1mr", "DLmr", "Dw", "D1mw", "DLmw")


def _inner(steps: int, what: str) -> None:
    """The run valgrind watches: ``steps`` steps of the eager or hand-written step, caches
    emptied after every kernel."""
    sys.path.insert(0, HERE)
    import eager_dispatch_cpu as e
    import tp_mlp_vs_mpi4py as tp

    import mpipar as dist
    from mpipar.ops.dispatch import registered_ops

    tp.BATCH, tp.IN, tp.HIDDEN = 4, 8, 16
    buffer = np.ones(EVICT_BYTES // 8)

    def stream() -> None:
        np.add(buffer, 1.0, out=buffer)

    def then_stream(fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            stream()
            return out

        return wrapped

    if what == "eager":
        for op in registered_ops():
            object.__setattr__(op, "kernel", then_stream(op.kernel))  # (a frozen dataclass: benchmark only)
        dist.optimizer.SGD._update = then_stream(dist.optimizer.SGD._update)  # type: ignore[method-assign]
        dist.set_backend(e.RankZero(e.RANKS))
        step = e.phases()["eager step"]
    else:
        step = _hand_step(tp, e.RANKS, stream)
    for _ in range(steps):
        stream()
        step()


def _hand_step(tp: Any, ranks: int, stream: Any) -> Any:
    """``tp_mlp_vs_mpi4py.hand_written``'s arithmetic on rank 0's shards, streaming after each
    NumPy call (the all-reduce a local scaling, as the eager step's stand-in)."""
    v = tp.initial()
    cols = slice(0, tp.HIDDEN // ranks)
    x, lr = v["x"], tp.LR
    w1, b1 = v["w1"][:, cols].copy(), v["b1"][cols].copy()
    w2, b2 = v["w2"][cols].copy(), v["b2"].copy()
    y = np.empty((tp.BATCH, tp.IN), np.float32)
    s = stream

    def step() -> float:
        a = x @ w1
        s()
        a = a + b1
        s()
        h = np.maximum(a, 0)
        s()
        m = h @ w2
        s()
        y[...] = m * np.float32(ranks)
        s()
        z = y + b2
        s()
        zz = z * z
        s()
        loss = float(np.mean(zz))
        s()
        gz = z * np.float32(2 / z.size)
        s()
        gh = gz @ w2.T
        s()
        gh = gh * (h > 0)
        s()
        w2[...] -= lr * (h.T @ gz)
        s()
        b2[...] -= lr * gz.sum(0)
        s()
        w1[...] -= lr * (x.T @ gh)
        s()
        b1[...] -= lr * gh.sum(0)
        s()
        return loss

    return step


def _per_function(path: str) -> dict[str, list[int]]:
    """cachegrind's counts per function, summed over its lines."""
    events: list[str] = []
    totals: dict[str, list[int]] = {}
    fn = ""
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("fn="):
                fn = line[3:].strip()
            elif line[:1].isdigit():
                values = [int(v) for v in line.split()[1:]]
                values += [0] * (len(events) - len(values))
                have = totals.get(fn)
                totals[fn] = values if have is None else [a + b for a, b in zip(have, values, strict=True)]
    if list(events) != list(EVENTS):
        raise SystemExit(f"eager_cold_cost: unexpected cachegrind events {events} in {path}")
    return totals


def _counts(steps: int, what: str, workdir: str) -> dict[str, list[int]]:
    out = os.path.join(workdir, f"{what}-{steps}.out")
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES, f"--cachegrind-out-file={out}"]
    cmd += [sys.executable, os.path.abspath(__file__), "--inner", str(steps), "--what", what]
    done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"eager_cold_cost: valgrind failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return _per_function(out)


def per_step(what: str, low: int, high: int, workdir: str) -> dict[str, float]:
    """Counts per step of ``what``: the run of ``high`` steps minus the run of ``low``."""
    a, b = _counts(low, what, workdir), _counts(high, what, workdir)
    zero = [0] * len(EVENTS)
    sums = [0.0] * len(EVENTS)
    for fn in set(a) | set(b):
        if STREAMING in fn:
            continue
        for i, (x, y) in enumerate(zip(a.get(fn, zero), b.get(fn, zero), strict=True)):
            sums[i] += (y - x) / (high - low)
    got = dict(zip(EVENTS, sums, strict=True))
    got["estimate"] = (
        got["Ir"] + 10 * (got["I1mr"] + got["D1mr"] + got["D1mw"]) + 60 * (got["ILmr"] + got["DLmr"] + got["DLmw"])
    )
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, nargs=2, default=[5, 25], metavar=("A", "B"))
    p.add_argument("--inner", type=int, help=argparse.SUPPRESS)
    p.add_argument("--what", choices=["eager", "hand"], default="eager", help=argparse.SUPPRESS)
    sys.path.insert(0, HERE)
    from results import add_json_argument, record

    add_json_argument(p)
    args = p.parse_args()
    if args.inner is not None:
        _inner(args.inner, args.what)
        return 0
    low, high = sorted(args.steps)
    if low < 1 or high <= low:
        p.error("--steps A B: two step counts, 1 <= A < B")
    if shutil.which("valgrind") is None:
        print("eager_cold_cost: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 1
    record(args.json, __file__)
    with tempfile.TemporaryDirectory() as workdir:
        rows = {what: per_step(what, low, high, workdir) for what in ("eager", "hand")}
    rows["eager - hand"] = {k: rows["eager"][k] - rows["hand"][k] for k in rows["eager"]}
    print(f"per step, caches emptied after every kernel (cachegrind; {high} - {low} steps):")
    cols = ("Ir", "I1mr", "D1mr", "ILmr", "DLmr", "DLmw", "estimate")
    print(f"{'':14s}" + "".join(f"{c:>11s}" for c in cols))
    for name, row in rows.items():
        print(f"{name:14s}" + "".join(f"{row[c]:11.0f}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
