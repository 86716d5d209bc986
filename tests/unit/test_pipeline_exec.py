"""Scheduled pipelines through dist.to_static: equal to the reference under all four schedules.

Subprocess tests run the examples (seed_hybrid, primer_pp and gpt.py with
pp=2 and pp=4): each simulator run once, compared with the reference and with ``mpiexec``,
where one launch per example runs the four schedules in turn; in-process tests pin the executor's behaviour: losses equal eager mode,
ZBH1 really defers weight gradients, 1F1B bounds the micro-batches in flight, the plan.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np
import pytest
from conftest import VENV_BIN
from processes import environ
from processes import run as run_command
from test_examples import LOSS, losses, run

import mpipar as dist
from mpipar.pipeline import runner as runner_mod

SCHEDULES = ["FThenB", "1F1B", "Interleaved1F1B", "ZBH1"]
EXAMPLES = [
    ("paddle_auto/hybrid.py", [], 8),
    ("paddle_auto/primer_pp.py", [], 2),
    ("gpt.py", ["--mesh", "dp=2,tp=2,pp=2"], 8),
    ("gpt.py", ["--mesh", "dp=2,pp=4"], 8),
]


def _args(script: str, extra: list[str], schedule: str) -> list[str]:
    """The example's command line (after ``python``) under ``schedule``."""
    return [
        os.path.join("examples", script),
        "--tiny",
        "--dtype",
        "float64",
        "--steps",
        "3",
        "--schedule",
        schedule,
        *extra,
    ]


@functools.cache
def _simulated(n: int, *common: str) -> tuple[float, ...]:
    """The losses of ``python -m simulator -n n *common``: run once for both tests below, which
    compare the same simulator run with the reference and with ``mpiexec``."""
    return tuple(losses(run("-m", "simulator", "-n", str(n), *common)))


@functools.cache
def _under_mpi(script: str, extra: tuple[str, ...], n: int) -> dict[str, list[float]]:
    """The losses rank 0 prints under ``mpiexec -n n`` for each schedule: one launch runs the
    example under the four schedules in turn (``tests/mpi_scripts/run_examples.py``, which
    marks where each run begins)."""
    argv: list[str] = []
    for schedule in SCHEDULES:
        argv += [*(["--"] if argv else []), *_args(script, list(extra), schedule)]
    out = run_command(
        [os.path.join(VENV_BIN, "mpiexec"), "-n", str(n), sys.executable, "tests/mpi_scripts/run_examples.py", *argv],
        env=environ(drop=("MPIPAR_BACKEND", "MPIPAR_TRACE")),
        timeout=300 * len(SCHEDULES),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    runs = re.split(r"^=== .*$", out.stdout, flags=re.M)[1:]  # rank 0's lines carry no prefix
    assert len(runs) == len(SCHEDULES), out.stdout[-4000:]
    return {schedule: [float(v) for _, v in LOSS.findall(text)] for schedule, text in zip(SCHEDULES, runs, strict=True)}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("script", "extra", "n"), EXAMPLES, ids=[f"{s[:-3]}{''.join(e)}" for s, e, _ in EXAMPLES])
def test_schedules_match_the_reference(schedule: str, script: str, extra: list[str], n: int) -> None:
    common = _args(script, extra, schedule)
    ref = losses(run("-m", "simulator", "--reference", *common))
    sim = _simulated(n, *common)
    assert len(ref) == 3
    for a, b in zip(ref, sim, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a), (ref, sim)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("script", "extra", "n"), EXAMPLES, ids=[f"{s[:-3]}{''.join(e)}" for s, e, _ in EXAMPLES])
def test_schedules_under_mpi_match_the_simulator(schedule: str, script: str, extra: list[str], n: int) -> None:
    sim = _simulated(n, *_args(script, extra, schedule))
    mpi = _under_mpi(script, tuple(extra), n)[schedule]
    for a, b in zip(sim, mpi, strict=True):
        assert abs(a - b) <= 1e-9 * abs(a), (sim, mpi)


# --------------------------------------------------------------------------- in-process
F = dist.nn.functional


class TwoStage(dist.nn.Layer):
    def __init__(self, mesh0: dist.ProcessMesh, mesh1: dist.ProcessMesh) -> None:
        super().__init__(dtype="float64")
        with dist.nn.layer.default_dtype("float64"):
            self.a = dist.nn.Linear(6, 12)
            self.b = dist.nn.Linear(12, 3)
        dist.shard_layer(self.a, mesh0)
        dist.shard_layer(self.b, mesh1)
        self.mesh1 = mesh1

    def forward(self, x: dist.Tensor) -> dist.Tensor:
        h = dist.reshard(F.dropout(F.relu(self.a(x)), 0.2), self.mesh1, [dist.Shard(0)])
        return self.b(h)


def _meshes() -> tuple[dist.ProcessMesh, dist.ProcessMesh]:
    return dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])


def _data(step: int, m0: dist.ProcessMesh, m1: dist.ProcessMesh) -> tuple[dist.Tensor, dist.Tensor]:
    rng = np.random.default_rng(step)
    x = dist.shard_tensor(rng.standard_normal((16, 6)), m0, [dist.Shard(0)])
    y = dist.shard_tensor(rng.integers(0, 3, (16,)), m1, [dist.Shard(0)])
    return x, y


def _train(schedule: str | None, steps: int = 3) -> tuple[list[float], dist.DistModel | None]:
    dist.seed(3)
    m0, m1 = _meshes()
    model = TwoStage(m0, m1)
    opt = dist.optimizer.Momentum(learning_rate=0.1, parameters=model.parameters())
    if schedule is None:  # eager: micro-batches by hand, as a user would accumulate them
        out = []
        for step in range(steps):
            x, y = _data(step, m0, m1)
            total = None
            for xs, ys in runner_mod.batch_parts([x, y], 4):
                loss = F.cross_entropy(model(xs), ys)
                dist.scale(loss, 0.25).backward()
                total = loss if total is None else dist.add(total, loss)
            opt.step()
            opt.clear_grad()
            out.append(float(total) / 4)
        return out, None
    strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": schedule, "accumulate_steps": 4}})
    dm = dist.to_static(model, None, lambda out, y: F.cross_entropy(out, y), opt, strategy)
    return [float(dm(*_data(step, m0, m1))) for step in range(steps)], dm


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B", "ZBH1"])
def test_pipeline_losses_equal_eager_micro_batching(schedule: str) -> None:
    eager, _ = _train(None)
    piped, _ = _train(schedule)
    np.testing.assert_allclose(piped, eager, rtol=1e-12)


def test_zbh1_defers_weight_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    deferred_items: list[int] = []
    real = dist.autograd.DeferredWeights.run

    def spy(self: dist.autograd.DeferredWeights) -> None:
        deferred_items.append(len(self.items))
        real(self)

    monkeypatch.setattr(dist.autograd.DeferredWeights, "run", spy)
    _train("ZBH1", steps=1)
    assert len(deferred_items) == 2 * 4  # one W per stage and micro-batch
    assert all(n > 0 for n in deferred_items)  # each W had weight gradients to compute
    deferred_items.clear()
    _train("1F1B", steps=1)
    assert all(n == 0 for n in deferred_items)


def test_one_f_one_b_bounds_micro_batches_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    peaks: dict[str, int] = {}
    for schedule in ("FThenB", "1F1B"):
        live: dict[int, int] = {0: 0, 1: 0}
        peak = {0: 0, 1: 0}
        forward, backward = runner_mod.PipelineRunner._forward, runner_mod.PipelineRunner._backward

        def f(self, s, m, _f=forward, live=live, peak=peak):  # type: ignore[no-untyped-def]
            live[s] += 1
            peak[s] = max(peak[s], live[s])
            return _f(self, s, m)

        def b(self, s, m, split, _b=backward, live=live):  # type: ignore[no-untyped-def]
            live[s] -= 1
            return _b(self, s, m, split)

        monkeypatch.setattr(runner_mod.PipelineRunner, "_forward", f)
        monkeypatch.setattr(runner_mod.PipelineRunner, "_backward", b)
        _train(schedule, steps=1)
        monkeypatch.undo()
        peaks[schedule] = peak[0]
    assert peaks["FThenB"] == 4 and peaks["1F1B"] == 2  # min(p - i, m) for stage 0 of 2


def test_plan_of_a_pipelined_model() -> None:
    _, dm = _train("1F1B", steps=1)
    assert dm is not None
    plan = dm.plan
    assert plan.pipeline is not None and plan.pipeline["num_microbatches"] == 4
    assert [s["stage"] for s in plan.pipeline["stages"]] == [0, 1]
    assert plan.pipeline["schedule"]["kind"] == "1F1B"
    assert plan.comm_counts("forward") == {"transfer": 1}
    assert plan.comm_counts("backward").get("transfer") == 1 and plan.comm_counts("backward").get("all_reduce") == 4
    assert {o.phase for o in plan.ops} == {"forward", "backward"}


def test_micro_batches_must_divide_the_shards() -> None:
    m0, _ = _meshes()
    x = dist.shard_tensor(np.zeros((6, 2)), m0, [dist.Shard(0)])
    with pytest.raises(
        ValueError,
        match=r"6 rows cannot be cut into 4 equal micro-batches over 2 data-parallel shard\(s\): 6 must be divisible by 2 \* 4 = 8",
    ):
        runner_mod.split_microbatches(x, 4)


def test_interleaving_needs_stages_on_repeating_meshes() -> None:
    m0, m1 = _meshes()
    model = TwoStage(m0, m1)
    opt = dist.optimizer.SGD(parameters=model.parameters())
    strategy = dist.Strategy(
        {"pipeline": {"enable": True, "schedule_mode": "Interleaved1F1B", "accumulate_steps": 2, "vpp_degree": 2}}
    )
    dm = dist.to_static(model, None, lambda out, y: F.cross_entropy(out, y), opt, strategy)
    with pytest.raises(ValueError, match="vpp_degree = 2, but the model places 2 stages on 2 meshes"):
        dm(*_data(0, m0, m1))


def test_a_pipeline_batch_may_carry_none_and_plain_arrays() -> None:
    """A batch with no labels (None) and a plain NumPy input: None reaches the loss in every
    micro-batch, the array is cut as a dense tensor; the loss equals the same step with the
    input given as a dense Tensor. Anything else is refused by name."""
    parts = runner_mod.batch_parts([np.arange(8.0).reshape(4, 2), None], 2)
    assert [p[1] for p in parts] == [None, None]
    np.testing.assert_array_equal(parts[1][0].numpy(), np.arange(4.0, 8.0).reshape(2, 2))
    with pytest.raises(TypeError, match="batch input 0 is a object; a pipeline cuts tensors, arrays or None"):
        runner_mod.batch_parts([object()], 2)

    def step(x: object) -> float:
        dist.seed(3)
        m0, m1 = _meshes()
        model = TwoStage(m0, m1)
        opt = dist.optimizer.Momentum(learning_rate=0.1, parameters=model.parameters())
        strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 4}})
        seen: list[object] = []

        def loss(out: dist.Tensor, y: object) -> dist.Tensor:
            seen.append(y)
            return dist.mean(dist.multiply(out, out))

        dm = dist.to_static(model, None, loss, opt, strategy)
        value = float(dm(x, None))
        assert len(seen) >= 4 and all(y is None for y in seen)  # every micro-batch (and the probe) saw None
        return value

    x = np.random.default_rng(0).standard_normal((16, 6))
    assert step(x) == step(dist.Tensor(x))
