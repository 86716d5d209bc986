"""The captured training step under MPI: bit-identical to eager, with the same collectives.

    mpiexec -n 4 python tests/mpi_scripts/capture_step.py --steps 6

For each case (the tensor-parallel MLP with SGD -- whose program updates the weights in place
--, with AdamW, and a data-parallel one) two copies of the model start from the same values;
one takes eager steps, the other ``compile_step(step, capture=True)`` steps, on the same
batches. Every step's loss, every parameter after the run and every optimizer state are
compared bit for bit (float64), and so are the collectives each captured step made
(CommDebugMode) with the eager step's on even steps; odd steps run with nothing listening,
so the program's reshards take their bound paths (an all-reduce bound to the communicator's
gather and fold). Last, ``to_static(..., capture=True)`` trains a ``Linear`` MLP against
``to_static`` without capture (case ``static``). Each rank prints ``ok <case> captured <calls>``; with ``--print-losses`` also
``loss <case> <step> <repr>`` for each captured step, so a test can compare the MPI and NCCL
backends' runs bit for bit. Runs under the MPI backend or the NCCL one (``MPIPAR_BACKEND=nccl``,
through ``nccl_standin_run.py`` in CI).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

# A captured step replays one all-reduce per gradient; the eager twin must make the same ones
# for the collectives to be compared call for call, so the default gradient buckets are off.
os.environ.setdefault("MPIPAR_GRAD_BUCKET_MIB", "off")

import numpy as np

import mpipar as dist

F = dist.nn.functional


def build(
    n: int, layout: str, opt: str
) -> tuple[Callable[[dist.Tensor], dist.Tensor], list[dist.Tensor], Any, dist.ProcessMesh]:
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])
    rng = np.random.default_rng(0)
    hidden = 8 * n
    tp = layout == "tp"
    w1 = dist.shard_tensor(
        dist.Parameter(rng.standard_normal((6, hidden))), mesh, [dist.Shard(1) if tp else dist.Replicate()]
    )
    b1 = dist.shard_tensor(
        dist.Parameter(rng.standard_normal(hidden)), mesh, [dist.Shard(0) if tp else dist.Replicate()]
    )
    w2 = dist.shard_tensor(
        dist.Parameter(rng.standard_normal((hidden, 6))), mesh, [dist.Shard(0) if tp else dist.Replicate()]
    )
    b2 = dist.shard_tensor(dist.Parameter(rng.standard_normal(6)), mesh, [dist.Replicate()])
    params = [w1, b1, w2, b2]
    optimizer = (dist.optimizer.SGD if opt == "sgd" else dist.optimizer.AdamW)(learning_rate=0.01, parameters=params)

    def step(x: dist.Tensor) -> dist.Tensor:
        h = F.relu(dist.add(dist.matmul(x, w1), b1))
        z = dist.add(dist.matmul(h, w2), b2)
        loss = dist.mean(dist.multiply(z, z))
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        return loss

    return step, params, optimizer, mesh


def events(comm: dist.CommDebugMode) -> list[tuple[Any, ...]]:
    return [(e.op, e.ranks, e.input_nbytes, e.output_nbytes, e.dtype, e.reduce_type) for e in comm.events]


def nccl_calls() -> int | None:
    """The NCCL calls the CuPy/NCCL stand-in (``tests/nccl_standin``) has carried so far; None
    under any other backend. A captured step must move its data through NCCL as eager does:
    a bound path that took MPI on host memory instead would carry fewer."""
    cupy = sys.modules.get("cupy")
    if cupy is None or not getattr(cupy, "STANDIN", False):
        return None
    return sum(cupy.cuda.nccl.state.calls.values())


def run_case(n: int, layout: str, opt: str, steps: int, print_losses: bool = False) -> int:
    eager_step, eager_params, eager_opt, mesh = build(n, layout, opt)
    step, params, optimizer, _ = build(n, layout, opt)
    fn = dist.compile_step(step, capture=True)
    rng = np.random.default_rng(1)
    for i in range(steps):
        x = dist.shard_tensor(
            rng.standard_normal((4 * n, 6)), mesh, [dist.Replicate() if layout == "tp" else dist.Shard(0)]
        )
        if i % 2:  # nothing listens: the program's reshards run bound (``bound_all_reduce``, the step's runner)
            before, ran = nccl_calls(), fn.captured_calls
            want = eager_step(x)
            between = nccl_calls()
            got = fn(x)
            after = nccl_calls()
            # A traced call also agrees across ranks and validates: only a program run compares.
            if before is not None and between is not None and after is not None and fn.captured_calls > ran:
                assert after - between == between - before > 0, (layout, opt, i, between - before, after - between)
        else:  # observers hear every collective: the program runs them as eager does, which the events check
            with dist.CommDebugMode() as want_comm:
                want = eager_step(x)
            with dist.CommDebugMode() as got_comm:
                got = fn(x)
            if fn.captured_calls and fn.captured:
                assert events(got_comm) == events(want_comm), (layout, opt, i, got_comm.table(), want_comm.table())
        assert np.array_equal(got.full_tensor(), want.full_tensor()), (layout, opt, i)
        if print_losses:
            print(f"loss {layout}-{opt} {i} {float(got.full_tensor())!r}", flush=True)
    assert fn.captured, fn.capture_refused
    program = next(c.program for c in fn._captures.values() if c.program is not None)
    if dist.current_backend().name != "mpi":  # in-place updates ask NumPy's memory flags: off on device arrays
        assert not any(program.alone_flags), program.alone_flags
    elif opt == "sgd":  # the program overwrote the weights in place (nothing else held them)
        assert program.alone_flags and all(program.alone_flags), program.alone_flags
    for a, b in zip(params, eager_params, strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor())
        s, t = optimizer._states[id(a)], eager_opt._states[id(b)]
        assert s["step"] == t["step"] == steps
        for name in optimizer.state_names:
            assert np.array_equal(s[name].full_tensor(), t[name].full_tensor())
    return fn.captured_calls


def run_static(n: int, steps: int, print_losses: bool = False) -> int:
    """``to_static(..., capture=True)``, which trains through ``compile_step(capture=True)``: a
    column- then row-parallel MLP of ``Linear`` layers with Momentum, against the same model
    under ``to_static`` without capture; every loss and weight bit for bit."""
    mesh = dist.ProcessMesh(list(range(n)), dim_names=["x"])

    def build() -> tuple[dist.nn.Layer, Any]:
        dist.seed(1)
        with dist.nn.layer.default_dtype("float64"):
            l1, l2 = dist.nn.Linear(6, 8 * n), dist.nn.Linear(8 * n, 6)
        dist.shard_tensor(l1.weight, mesh, [dist.Shard(1)])
        dist.shard_tensor(l1.bias, mesh, [dist.Shard(0)])
        dist.shard_tensor(l2.weight, mesh, [dist.Shard(0)])
        dist.shard_tensor(l2.bias, mesh, [dist.Replicate()])
        model = dist.nn.Sequential(l1, dist.nn.ReLU(), l2)
        return model, dist.optimizer.Momentum(learning_rate=0.05, parameters=model.parameters())

    def mse(out: dist.Tensor, y: dist.Tensor) -> dist.Tensor:
        d = dist.subtract(out, y)
        return dist.mean(dist.multiply(d, d))

    m1, o1 = build()
    m2, o2 = build()
    plain = dist.to_static(m1, None, mse, o1)
    captured = dist.to_static(m2, None, mse, o2, capture=True)
    rng = np.random.default_rng(2)
    for i in range(steps):
        x, y = (dist.shard_tensor(rng.standard_normal((4 * n, 6)), mesh, [dist.Replicate()]) for _ in range(2))
        want, got = plain(x, y).full_tensor(), captured(x, y).full_tensor()
        assert np.array_equal(got, want), ("static", i)
        if print_losses:
            print(f"loss static {i} {float(got)!r}", flush=True)
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor())
    assert captured.replay.captured, captured.replay.capture_refused
    return captured.replay.captured_calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--print-losses", action="store_true", help="print repr() of each captured step's loss")
    args = p.parse_args()
    backend = dist.current_backend()
    if backend.name not in ("mpi", "nccl"):
        raise SystemExit("run me under mpiexec (MPIPAR_BACKEND=mpi or nccl)")
    n = backend.world_size
    for layout, opt in (("tp", "sgd"), ("tp", "adamw"), ("dp", "sgd")):
        calls = run_case(n, layout, opt, args.steps, args.print_losses)
        print(f"ok {layout}-{opt} captured {calls}", flush=True)
    print(f"ok static captured {run_static(n, args.steps, args.print_losses)}", flush=True)


if __name__ == "__main__":
    main()
