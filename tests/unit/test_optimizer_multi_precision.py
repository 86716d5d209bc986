"""``multi_precision=True``: float32 master weights and states for 16-bit parameters.

Checked against an independent float64 AdamW, on dense and distributed (ZeRO-1) parameters,
in shape-only mode (what the estimator relies on), and through ``state_dict``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpipar as dist
from simulator import ShapeOnlyBackend

SHAPE = (4, 6)


def _param(value: np.ndarray, dtype: str = "float16") -> dist.Parameter:
    return dist.Parameter(value, dtype=dtype, name="w")


def _grads(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal(SHAPE).astype(np.float16) for _ in range(steps)]


def _backward_with(p: dist.Tensor, g: np.ndarray) -> None:
    """Give ``p`` the gradient ``g`` through a real backward: d/dp sum(p * g) = g."""
    c = dist.Tensor(g.astype(p.dtype))
    if p.is_dist:
        c = dist.shard_tensor(c, p.process_mesh, [dist.Replicate()] * p.process_mesh.ndim)
    dist.sum(dist.multiply(p, c)).backward()


def _adamw_reference(p0: np.ndarray, grads: list[np.ndarray], lr: float, coeff: float) -> np.ndarray:
    """Paddle's AdamW in float64, written out independently of the optimizer."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    p, m, v = p0.astype(np.float64), np.zeros(SHAPE), np.zeros(SHAPE)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        p = p * (1 - lr * coeff)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        p = p - lr_t * m / (np.sqrt(v) + eps * math.sqrt(1 - b2**t))
    return p


def test_master_weight_follows_float32_adamw_and_the_parameter_is_its_cast() -> None:
    p0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float16)
    p = _param(p0)
    opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=[p], weight_decay=0.1, multi_precision=True)
    grads = _grads(5)
    for g in grads:
        _backward_with(p, g)
        opt.step()
        opt.clear_grad()
    states = opt.state_tensors()
    master = states[f"{p.name}.master_weight"].full_tensor()
    assert master.dtype == np.float32 and p.dtype == np.float16
    assert {states[f"{p.name}.{n}"].dtype for n in ("moment1", "moment2")} == {np.dtype(np.float32)}
    np.testing.assert_allclose(master, _adamw_reference(p0, grads, 1e-2, 0.1), rtol=2e-6, atol=2e-7)
    np.testing.assert_array_equal(p.full_tensor(), master.astype(np.float16))


def test_small_updates_survive_only_with_a_master_copy() -> None:
    """lr * g = 1e-4 is below half a float16 step at 1.0 (4.9e-4): without a master it is rounded away."""
    g = np.full(SHAPE, 1e-2, dtype=np.float16)
    finals = {}
    for mp in (False, True):
        p = _param(np.ones(SHAPE, dtype=np.float16))
        opt = dist.optimizer.SGD(learning_rate=1e-2, parameters=[p], multi_precision=mp)
        for _ in range(50):
            _backward_with(p, g)
            opt.step()
            opt.clear_grad()
        finals[mp] = p.full_tensor()
    np.testing.assert_array_equal(finals[False], np.ones(SHAPE, dtype=np.float16))
    expected = np.float16(1.0 - 50 * 1e-2 * float(np.float16(1e-2)))
    np.testing.assert_array_equal(finals[True], np.full(SHAPE, expected))


def test_float32_parameters_get_no_master_copy() -> None:
    p = _param(np.ones(SHAPE, dtype=np.float32), dtype="float32")
    opt = dist.optimizer.Momentum(learning_rate=0.1, parameters=[p], multi_precision=True)
    _backward_with(p, _grads(1)[0])
    opt.step()
    assert set(opt.state_tensors()) == {f"{p.name}.velocity"}
    assert not opt.uses_master_weight(p)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_distributed_update_equals_the_dense_one(zero: int) -> None:
    """dp=2 (ZeRO-1/3: master and moments split over dp) computes the dense run's values bit for bit."""
    p0 = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float16)
    grads = _grads(3)

    def run(distributed: bool) -> tuple[np.ndarray, dict[str, dist.Tensor]]:
        p = _param(p0)
        if distributed:
            dist.shard_tensor(p, dist.ProcessMesh([0, 1], dim_names=["dp"]), [dist.Replicate()])
        opt = dist.optimizer.AdamW(learning_rate=1e-2, parameters=[p], multi_precision=True)
        if distributed and zero:
            opt = dist.shard_optimizer(opt, {1: dist.ShardingStage1, 3: dist.ShardingStage3}[zero]("dp"))
        for g in grads:
            _backward_with(p, g)
            opt.step()
            opt.clear_grad()
        return p.full_tensor(), opt.state_tensors()

    dense, _ = run(False)
    spread, states = run(True)
    np.testing.assert_array_equal(spread, dense)
    master = next(t for k, t in states.items() if k.endswith(".master_weight"))
    assert master.dtype == np.float32 and all(t.dtype == np.float32 for t in states.values())
    for t in states.values():
        assert int(np.prod(t.spec.local_shape(0))) == (12 if zero else 24)


def test_shape_only_step_creates_float32_states_in_the_zero_layout() -> None:
    """What the estimator reads: 2 + 2 + 12 bytes per parameter element for 16-bit AdamW."""
    with dist.use_backend(ShapeOnlyBackend()):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "tp"])
        p = dist.shard_tensor(dist.Tensor.abstract((8, 16), np.float16), mesh, [dist.Replicate(), dist.Shard(1)])
        p.stop_gradient = False
        opt = dist.shard_optimizer(
            dist.optimizer.AdamW(parameters=[p], multi_precision=True), dist.ShardingStage1("dp")
        )
        x = dist.shard_tensor(dist.Tensor.abstract((4, 8), np.float16), mesh, [dist.Shard(0), dist.Replicate()])
        dist.sum(dist.matmul(x, p)).backward()
        opt.step()
        report = dist.memory_report(parameters=[p], optimizer=opt)
    local = 8 * 16 // 2  # split over tp
    for r in range(4):
        got = report.per_rank[r]
        assert (got["parameters"], got["gradients"]) == (2 * local, 2 * local)
        assert got["optimizer_state"] == 3 * 4 * local // 2  # m, v, master in float32, split over dp


def test_state_dict_round_trip_keeps_the_master() -> None:
    p0 = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float16)
    grads = _grads(4)

    def fresh(value: np.ndarray) -> tuple[dist.Tensor, dist.optimizer.AdamW]:
        p = _param(value)
        return p, dist.optimizer.AdamW(learning_rate=1e-2, parameters=[p], multi_precision=True)

    p, opt = fresh(p0)
    for g in grads[:2]:
        _backward_with(p, g)
        opt.step()
        opt.clear_grad()
    saved = {k: (v.full_tensor() if isinstance(v, dist.Tensor) else v) for k, v in opt.state_dict().items()}
    assert saved[f"{p.name}.master_weight"].dtype == np.float32
    q, again = fresh(p.full_tensor())  # a resumed run: the 16-bit weights and the saved states
    again.set_state_dict(saved)
    for opt_, par in ((opt, p), (again, q)):
        for g in grads[2:]:
            _backward_with(par, g)
            opt_.step()
            opt_.clear_grad()
    np.testing.assert_array_equal(q.full_tensor(), p.full_tensor())
    np.testing.assert_array_equal(
        again.state_tensors()[f"{q.name}.master_weight"].full_tensor(),
        opt.state_tensors()[f"{p.name}.master_weight"].full_tensor(),
    )
    bad = dict(saved)
    bad[f"{p.name}.moment1"] = saved[f"{p.name}.moment1"].astype(np.float16)
    with pytest.raises(ValueError, match=r"moment1' is float16\[4, 6\], but its parameter .* kept as float32"):
        fresh(p0)[1].set_state_dict(bad)
