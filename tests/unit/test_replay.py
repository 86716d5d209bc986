"""The replayed step (``dist.compile_step``, ``to_static``): bit-identical to eager, retraced on change.

Every comparison runs the same program twice from the same initial state -- once eagerly, once
through ``compile_step`` -- and compares losses and parameters with ``np.array_equal`` and the
collectives with their full event lists (op, group, bytes, dtype, reduction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tp_mlp_layer import MLP, comm_events, mlp_loss, mlp_parameters, mse, sharded_mlp  # tests/tp_mlp_layer.py

import mpipar as dist
from mpipar.models.gpt import GPT, GPTConfig, GPTParallel
from mpipar.ops import dispatch
from simulator import SimBackend


@pytest.fixture(autouse=True)
def _sim4() -> Any:
    with dist.use_backend(SimBackend(4)):
        yield


def _params(ps: list[dist.Tensor]) -> list[np.ndarray]:
    return [p.full_tensor() for p in ps]


def _run(
    build: Callable[[], tuple[Callable[..., dist.Tensor], list[dist.Tensor]]],
    batches: list[tuple[Any, ...]],
    compiled: bool,
) -> tuple[list[float], list[np.ndarray], list[tuple[Any, ...]], Any]:
    step, params = build()
    fn = dist.compile_step(step) if compiled else step
    losses = []
    with dist.CommDebugMode() as comm:
        for batch in batches:
            losses.append(float(fn(*batch).full_tensor()))
    return losses, _params(params), comm_events(comm), fn


def _assert_same(eager: tuple[Any, ...], replayed: tuple[Any, ...]) -> None:
    assert np.array_equal(np.array(eager[0]), np.array(replayed[0])), (eager[0], replayed[0])
    for a, b in zip(eager[1], replayed[1], strict=True):
        assert np.array_equal(a, b)
    assert eager[2] == replayed[2]  # the same collectives, in the same order, of the same sizes


# ---------------------------------------------------------------------------------- models
def tp_mlp(
    placements: str = "tp", adam: bool = True
) -> Callable[[], tuple[Callable[..., dist.Tensor], list[dist.Tensor]]]:
    """Megatron's MLP (``tp``: hidden split) or a data-parallel one (``dp``: batch split)."""

    def build() -> tuple[Callable[..., dist.Tensor], list[dist.Tensor]]:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        tp = placements == "tp"
        params = mlp_parameters(mesh, tp)
        opt = (dist.optimizer.Adam if adam else dist.optimizer.SGD)(learning_rate=0.01, parameters=params)

        def step(x: np.ndarray) -> dist.Tensor:
            xt = dist.shard_tensor(x, mesh, [dist.Replicate() if tp else dist.Shard(0)])
            loss = mlp_loss(xt, *params)
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        return step, params

    return build


def _batches(shapes: list[int], seed: int = 1) -> list[tuple[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((n, 6)),) for n in shapes]


# ---------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_replayed_mlp_steps_are_bit_identical(layout: str) -> None:
    batches = _batches([8] * 5)
    eager = _run(tp_mlp(layout), batches, compiled=False)
    replayed = _run(tp_mlp(layout), batches, compiled=True)
    _assert_same(eager, replayed)
    fn = replayed[3]
    assert fn.retraces == 1  # recorded once, then replayed
    assert fn.replayed_ops > 4 * 15  # every later step's ops came from the recording
    if layout == "tp":
        assert sum(1 for e in eager[2] if e[0] == "all_reduce") == 5  # one all-reduce per step


def test_shape_change_mid_run_retraces() -> None:
    batches = _batches([8, 8, 12, 12, 8, 12])
    eager = _run(tp_mlp("dp"), batches, compiled=False)
    replayed = _run(tp_mlp("dp"), batches, compiled=True)
    _assert_same(eager, replayed)
    assert replayed[3].retraces == 2  # batch 8, then batch 12; back to 8 and 12 replay


def test_parameter_placement_change_retraces() -> None:
    step, params = tp_mlp("tp", adam=False)()  # SGD: no optimizer state laid out like w1
    fn = dist.compile_step(step)
    x = _batches([8])[0][0]
    fn(x)
    fn(x)
    assert fn.retraces == 1
    mesh = params[0].spec.mesh
    dist.shard_tensor(params[0], mesh, [dist.Replicate()])  # w1 moved: the recording is stale
    loss = fn(x)
    assert fn.retraces == 2
    # And the step it ran is the eager one on the new layout.
    step2, params2 = tp_mlp("tp", adam=False)()
    step2(x)
    step2(x)
    dist.shard_tensor(params2[0], mesh, [dist.Replicate()])
    want = step2(x)
    assert np.array_equal(loss.full_tensor(), want.full_tensor())
    for a, b in zip(_params(params), _params(params2), strict=True):
        assert np.array_equal(a, b)


def test_data_dependent_branch_records_again_and_stays_exact() -> None:
    """A step whose ops depend on the data leaves its recording mid-way and records the rest."""

    def build() -> tuple[Callable[..., dist.Tensor], list[dist.Tensor]]:
        inner, params = tp_mlp("tp")()
        mesh = params[0].spec.mesh

        def step(x: np.ndarray) -> dist.Tensor:
            loss = inner(x)
            if float(loss.full_tensor()) > 30.0:  # an extra op on some steps only
                loss = dist.scale(loss, 0.5)
            return dist.add(loss, dist.shard_tensor(np.zeros(()), mesh, [dist.Replicate()]))

        return step, params

    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((8, 6)) * s,) for s in (1.0, 3.0, 1.0, 3.0, 1.0)]
    eager = _run(build, batches, compiled=False)
    replayed = _run(build, batches, compiled=True)
    _assert_same(eager, replayed)
    assert replayed[3].retraces >= 2


def test_replay_does_not_consult_rules() -> None:
    """After the first call the rules are not asked again: the decision cache is emptied and a
    replayed step still runs without refilling it."""
    step, _ = tp_mlp("tp")()
    fn = dist.compile_step(step)
    x = _batches([8])[0][0]
    fn(x)
    dispatch._DECISIONS.clear()
    fn(x)
    assert not dispatch._DECISIONS
    assert fn.retraces == 1


def test_gpt_steps_replayed_bit_identical() -> None:
    """The main job's GPT (dp2 x tp2, dropout, AdamW with global-norm clipping) in float64."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1, dtype="float64")
    rng = np.random.default_rng(7)
    data = [(rng.integers(0, cfg.vocab_size, (4, 8)), rng.integers(0, cfg.vocab_size, (4, 8))) for _ in range(3)]

    def build() -> tuple[Callable[..., dist.Tensor], list[dist.Tensor]]:
        dist.seed(3)  # the same weights and dropout draws for both runs
        par = GPTParallel.from_degrees(2, 2)
        model = GPT(cfg, par)
        opt = dist.optimizer.AdamW(
            learning_rate=1e-2, parameters=model.parameters(), grad_clip=dist.optimizer.ClipGradByGlobalNorm(1.0)
        )
        mesh = par.stage_meshes[0]

        def step(idx: np.ndarray, tgt: np.ndarray) -> dist.Tensor:
            x = dist.shard_tensor(idx, mesh, [dist.Shard(0), dist.Replicate()])
            y = dist.shard_tensor(tgt, mesh, [dist.Shard(0), dist.Replicate()])
            loss = model.loss(x, y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        return step, model.parameters()

    eager = _run(build, data, compiled=False)
    replayed = _run(build, data, compiled=True)
    _assert_same(eager, replayed)
    assert replayed[3].retraces == 1
    assert replayed[3].replayed_ops > 100


def test_to_static_replays_its_steps() -> None:
    """``to_static``'s steps replay: the same losses and weights as eager steps."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])

    def build() -> tuple[MLP, Any]:
        return sharded_mlp(mesh, dist.optimizer.SGD)

    loss_fn = mse

    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((8, 6)), rng.standard_normal((8, 6))) for _ in range(4)]

    def shard(a: np.ndarray) -> dist.Tensor:
        return dist.shard_tensor(a, mesh, [dist.Replicate()])

    m1, o1 = build()
    eager = []
    for x, y in data:
        loss = loss_fn(m1(shard(x)), shard(y))
        loss.backward()
        o1.step()
        o1.clear_grad()
        eager.append(float(loss.full_tensor()))
    m2, o2 = build()
    model = dist.to_static(m2, None, loss_fn, o2)
    static = [float(model(shard(x), shard(y)).full_tensor()) for x, y in data]
    assert np.array_equal(np.array(eager), np.array(static))
    for a, b in zip(_params(m1.parameters()), _params(m2.parameters()), strict=True):
        assert np.array_equal(a, b)
    assert model.replay.retraces == 1 and model.replay.replayed_ops > 0


def test_compile_step_rejects_non_callables() -> None:
    with pytest.raises(TypeError, match="compile_step needs a function"):
        dist.compile_step(3)  # type: ignore[arg-type]


def test_decision_cache_tells_apart_attributes_that_decide_dtypes_and_layouts() -> None:
    """Cached decisions are keyed on what decides them: ``cast``'s dtype, ``sum``'s axis."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    x = dist.shard_tensor(np.arange(24, dtype=np.float64).reshape(4, 6), mesh, [dist.Shard(0)])
    assert dist.cast(x, np.float32).dtype == np.float32
    assert dist.cast(x, np.float16).dtype == np.float16
    s0, s1 = dist.sum(x, axis=0), dist.sum(x, axis=1)
    assert s0.shape == [6] and s1.shape == [4]
    assert np.array_equal(s0.full_tensor(), x.full_tensor().sum(0))
    assert np.array_equal(s1.full_tensor(), x.full_tensor().sum(1))
    # A value-only attribute is no part of the key: the same decision, other values.
    assert np.array_equal(dist.scale(x, 2.0).full_tensor(), 2.0 * x.full_tensor())
    assert np.array_equal(dist.scale(x, 3.0).full_tensor(), 3.0 * x.full_tensor())


def test_another_backend_records_again() -> None:
    """Decisions hold the hosted ranks of their backend: a new backend is a new recording."""
    step, _ = tp_mlp("tp", adam=False)()
    fn = dist.compile_step(step)
    x = _batches([8])[0][0]
    fn(x)
    with dist.use_backend(SimBackend(4)):
        fn(x)
    assert fn.retraces == 2
    fn(x)
    assert fn.retraces == 2  # the first backend's recording is still there


def test_replay_checks_attributes_that_decide_dtypes() -> None:
    """The same step with a dtype argument: each call casts to the dtype it was given."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    x = dist.shard_tensor(np.ones((4, 2)), mesh, [dist.Shard(0)])
    fn = dist.compile_step(lambda dt: dist.cast(x, dt))
    assert [fn(dt).dtype for dt in (np.float32, np.float16, np.float16, np.float32)] == [
        np.float32,
        np.float16,
        np.float16,
        np.float32,
    ]
