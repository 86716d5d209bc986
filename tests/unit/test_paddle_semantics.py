"""Paddle's semantics where mpipar's used to differ, silently: the seeds' programs compute what
Paddle computes after the import rewrite (regression tests for the two silent failures), and the
smaller Paddle surfaces those programs use (metric, regularizer, sharding levels, shard specs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpipar as paddle
import mpipar.distributed as dist
from mpipar.compat.fleet import base
from mpipar.distributed import fleet
from mpipar.io import BatchSampler, DataLoader, Dataset
from simulator.backend import SimBackend
from simulator.per_rank import PerRankBackend


@pytest.fixture(autouse=True)
def _fresh_fleet() -> Iterator[None]:
    base._states.clear()
    yield
    base._states.clear()


def per_rank(n: int, program: Any) -> dict[int, Any]:
    backend = PerRankBackend(n)
    results: dict[int, Any] = {}
    with paddle.use_backend(backend):
        backend.world.run(lambda: results.__setitem__(paddle.get_rank(), program(paddle.get_rank())))
    return results


class OneField(Dataset):
    def __getitem__(self, index: int) -> np.ndarray:
        return np.random.default_rng(index).uniform(size=[3, 4]).astype("float64")

    def __len__(self) -> int:
        return 8


def test_a_single_field_dataset_batches_to_a_tensor_that_the_seeds_mark_in_place() -> None:
    """Seed 000 §4.1: ``dist.shard_tensor(x, mesh, [Shard(0)])`` without assignment marks the batch
    the model runs on, so the gradients are all-reduced over the data-parallel mesh. (A loader
    yielding a one-element list made the mark a discarded copy: the model ran dense, no reduction.)"""
    with paddle.use_backend(SimBackend(4)):
        mesh = paddle.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        paddle.seed(1)
        layer = paddle.nn.Linear(4, 2)
        loader = DataLoader(OneField(), batch_sampler=BatchSampler(OneField(), batch_size=4))
        x = next(iter(loader))
        assert isinstance(x, paddle.Tensor) and list(x.shape) == [4, 3, 4]
        with paddle.CommDebugMode() as mode:
            paddle.shard_tensor(x, mesh, [paddle.Shard(0)])
            loss = paddle.mean(layer(x))
            loss.backward()
        assert x.is_dist and x.placements == [paddle.Shard(0)]
        assert mode.counts().get("all_reduce", 0) >= 2  # the weight's and the bias's gradients


def test_fleet_model_parallel_broadcasts_the_inputs_within_the_model_group() -> None:
    """Seed 003's manual model parallelism: each rank reads its own batch (DistributedBatchSampler),
    ``fleet.distributed_model`` broadcasts the model group's first rank's inputs, as Paddle's
    TensorParallel does, so the row-parallel all-reduce sums one batch's partial products. (Without
    it the two ranks' batches were summed: inputs 1 and 2 gave -2.07 where Paddle gives -0.82.)"""

    def dense(x: np.ndarray) -> float:
        paddle.seed(3)
        with paddle.nn.layer.default_dtype("float64"):
            l1, l2 = paddle.nn.Linear(2, 4), paddle.nn.Linear(4, 1)
        return float(paddle.mean(l2(l1(paddle.to_tensor(x)))))

    def program(rank: int) -> float:
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
        fleet.init(is_collective=True, strategy=s)
        paddle.seed(3)
        with paddle.nn.layer.default_dtype("float64"):
            net = paddle.nn.Sequential(
                fleet.meta_parallel.ColumnParallelLinear(2, 4, gather_output=False, has_bias=True),
                fleet.meta_parallel.RowParallelLinear(4, 1, input_is_parallel=True, has_bias=True),
            )
        model = fleet.distributed_model(net)
        x = paddle.to_tensor(np.full((3, 2), float(rank + 1)))  # rank 0 reads ones, rank 1 twos
        out = model(x)
        assert np.all(x.numpy() == 1.0)  # broadcast in place, as Paddle's
        return float(paddle.mean(out))

    got = per_rank(2, program)
    want = dense(np.ones((3, 2)))
    assert got[0] == pytest.approx(want, rel=1e-12) and got[1] == pytest.approx(want, rel=1e-12)
    assert want != pytest.approx(dense(np.full((3, 2), 1.5)), rel=1e-6)  # the inputs matter


def test_distributed_optimizer_takes_the_strategy_after_a_bare_init() -> None:
    """Seed 001: ``fleet.init(is_collective=True)``, then the strategy (degrees in
    ``sharding_configs``) handed to ``distributed_optimizer``: its degrees take effect."""

    def program(rank: int) -> tuple[int, int]:
        fleet.init(is_collective=True)
        s = fleet.DistributedStrategy()
        s.sharding = True
        s.sharding_configs = {"sharding_degree": 2, "mp_degree": 1, "pp_degree": 1, "dp_degree": 1}
        layer = paddle.nn.Linear(2, 2)
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1, parameters=layer.parameters()), strategy=s)
        hcg = fleet.get_hybrid_communicate_group()
        return hcg.get_sharding_parallel_world_size(), hcg.get_data_parallel_world_size()

    assert per_rank(2, program) == {0: (2, 1), 1: (2, 1)}


def test_to_static_takes_a_loss_of_the_output_alone() -> None:
    """Seed 000 §4.5: ``dist.to_static(model, loader, paddle.mean, opt)`` and ``dist_model([x, y])``."""
    with paddle.use_backend(SimBackend(2)):
        paddle.seed(5)
        layer = paddle.nn.Linear(4, 2)
        opt = paddle.optimizer.SGD(0.1, parameters=layer.parameters())
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        x = dist.shard_tensor(np.arange(8.0).reshape(2, 4), mesh, [dist.Shard(0)])
        y = dist.shard_tensor(np.zeros((2, 2)), mesh, [dist.Shard(0)])
        want = float(paddle.mean(layer(x)))
        model = dist.to_static(layer, None, paddle.mean, opt)
        assert float(model([x, y])) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
def test_group_sharded_levels_compute_data_parallel_and_gather_at_level_3(level: str) -> None:
    data = np.random.default_rng(0).normal(size=(4, 3))

    def program(rank: int) -> tuple[np.ndarray, dict[str, int]]:
        fleet.init(is_collective=True)
        paddle.seed(9)
        with paddle.nn.layer.default_dtype("float64"):
            layer = paddle.nn.Linear(3, 2)
        opt = paddle.optimizer.Momentum(
            0.1, parameters=layer.parameters(), weight_decay=paddle.regularizer.L2Decay(0.01)
        )
        model, opt, _ = dist.sharding.group_sharded_parallel(layer, opt, level=level)
        mode = paddle.CommDebugMode() if rank == 0 else contextlib.nullcontext()
        with mode:
            for _ in range(2):
                loss = paddle.mean(model(paddle.to_tensor(data[2 * rank : 2 * rank + 2])))
                loss.backward()
                opt.step()
                opt.clear_grad()
        model.gather() if level == "p_g_os" else None
        counts = {} if mode is None or rank else {k: v for k, v in mode.counts().items()}
        return np.concatenate([p.numpy().ravel() for p in layer.parameters()]), counts

    def dense() -> np.ndarray:
        paddle.seed(9)
        with paddle.nn.layer.default_dtype("float64"):
            layer = paddle.nn.Linear(3, 2)
        opt = paddle.optimizer.Momentum(
            0.1, parameters=layer.parameters(), weight_decay=paddle.regularizer.L2Decay(0.01)
        )
        for _ in range(2):
            paddle.mean(layer(paddle.to_tensor(data))).backward()
            opt.step()
            opt.clear_grad()
        return np.concatenate([p.numpy().ravel() for p in layer.parameters()])

    got = per_rank(2, program)
    np.testing.assert_allclose(got[0][0], dense(), rtol=1e-12)
    np.testing.assert_allclose(got[1][0], dense(), rtol=1e-12)
    counts = got[0][1]
    if level == "p_g_os":
        assert counts.get("broadcast") == 2 * 2 and counts.get("reduce") == 2 * 2  # 2 params, 2 steps
    elif level == "os_g":
        assert counts.get("reduce") == 2 * 2 and counts.get("broadcast") == 2 * 2
    else:
        assert counts.get("all_reduce") == 2 and counts.get("broadcast") == 2 * 2


def test_metric_accuracy_and_accumulating_accuracy() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    label = np.array([[1], [1], [0], [0]])
    assert float(paddle.metric.accuracy(paddle.to_tensor(scores), paddle.to_tensor(label), k=1)) == 0.5
    assert float(paddle.metric.accuracy(input=paddle.to_tensor(scores), label=paddle.to_tensor(label), k=2)) == 0.75
    m = paddle.metric.Accuracy(topk=(1, 2))
    assert m.update(m.compute(paddle.to_tensor(scores), paddle.to_tensor(label))) == [0.5, 0.75]
    m.update(m.compute(paddle.to_tensor(scores[:2]), paddle.to_tensor(label[:2])))
    assert m.accumulate() == [3 / 6, 5 / 6] and m.name() == ["acc_top1", "acc_top2"]
    m.reset()
    assert m.accumulate() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"k = 4 is outside 1\.\.3"):
        paddle.metric.accuracy(paddle.to_tensor(scores), paddle.to_tensor(label), k=4)


def test_l1_decay_adds_coeff_times_sign() -> None:
    p = paddle.nn.Linear(2, 1).weight
    p.set_value(np.array([[0.5], [-2.0]], dtype=p.dtype))
    opt = paddle.optimizer.SGD(1.0, parameters=[p], weight_decay=paddle.regularizer.L1Decay(0.1))
    p.grad = paddle.to_tensor(np.zeros((2, 1), dtype=p.dtype))
    opt.step()
    np.testing.assert_allclose(p.numpy(), [[0.4], [-1.9]], rtol=1e-6)
    with pytest.raises(TypeError, match="weight_decay must be a float"):
        paddle.optimizer.SGD(1.0, parameters=[p], weight_decay="l2")


def test_shard_tensor_takes_the_older_shard_spec() -> None:
    with paddle.use_backend(SimBackend(2)):
        mesh = dist.ProcessMesh([0, 1], dim_names=["mp"])
        t = dist.auto_parallel.shard_tensor(np.zeros((4, 6)), mesh, [None, "mp"])
        assert t.placements == [dist.Shard(1)]
        with pytest.raises(ValueError, match=r"shard spec \['mp'\] has 1 entries for a tensor with 2 dims"):
            dist.shard_tensor(np.zeros((4, 6)), mesh, ["mp"])
        with pytest.raises(ValueError, match="no axis named 'dp'"):
            dist.shard_tensor(np.zeros((4, 6)), mesh, ["dp", None])


def test_print_shows_the_value_as_paddle_prints_it() -> None:
    """``print(loss)`` shows the value (the seeds print losses so), with Paddle's header; a
    distributed tensor adds its mesh and placements and shows the global value, made from the
    shards the simulator holds without communicating; ``repr`` stays the short metadata form."""
    x = paddle.to_tensor(np.float32(0.123456789))
    x.stop_gradient = False
    assert str(x) == "Tensor(shape=[], dtype=float32, place=Place(cpu), stop_gradient=False,\n       0.12345679)"
    assert f"{x}" == str(x) and f"{x:.3f}" == "0.123"
    assert str(paddle.to_tensor(np.array([[1.0, 2.0], [3.0, 4.5]]))).endswith(
        "stop_gradient=True,\n       [[1.00000000, 2.00000000],\n        [3.00000000, 4.50000000]])"
    )
    assert str(paddle.to_tensor(np.array([1, 2], dtype="int64"))).endswith(
        "dtype=int64, place=Place(cpu), stop_gradient=True,\n       [1, 2])"
    )
    with paddle.use_backend(SimBackend(4)):
        mesh = paddle.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
        a = np.arange(12.0).reshape(3, 4) / 8  # uneven shards along x
        w = paddle.shard_tensor(a, mesh, [paddle.Shard(0), paddle.Shard(1)])
        loss = paddle.sum(w)  # Partial on both axes
        with paddle.CommDebugMode() as comm:
            text = str(loss)
        assert not comm.events
        assert text == (
            "Tensor(shape=[], dtype=float64, place=Place(cpu), stop_gradient=True, "
            "process_mesh=ProcessMesh([[0, 1], [2, 3]], dim_names=['x', 'y']), "
            "placements=[Partial(reduce_type='sum'), Partial(reduce_type='sum')], GlobalDenseTensor=\n"
            "       8.25000000)"
        )
        assert repr(loss).startswith("DistTensor(shape=[], dtype=float64, mesh=")
        assert str(w).endswith(
            "GlobalDenseTensor=\n       [[0.00000000, 0.12500000, 0.25000000, 0.37500000],\n        [0.50000000, 0.62500000, 0.75000000, 0.87500000],\n        [1.00000000, 1.12500000, 1.25000000, 1.37500000]])"
        )


class GlobalDraws(Dataset):
    """Seed 000 §4.4's dataset: each sample drawn from NumPy's global generator when loaded."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return np.random.uniform(size=[2, 3]), np.random.uniform(size=[2, 3])

    def __len__(self) -> int:
        return 8


def test_shard_dataloader_reads_a_global_generator_dataset_as_one_device_does() -> None:
    """A dataset drawing from NumPy's global generator gives the batches a plain ``DataLoader``
    gives (no extra sample read first); every process reads the whole batch in order, so under
    ``mpiexec`` each rank's rows are one device's (``tests/mpi/test_mpi_examples.py`` runs seed
    000 §4.4 so: ``paddle_auto/hybrid.py``)."""
    np.random.seed(3)
    plain = [
        [f.numpy() for f in b]
        for b in DataLoader(GlobalDraws(), batch_sampler=BatchSampler(GlobalDraws(), batch_size=4))
    ]
    with paddle.use_backend(SimBackend(8)):
        mesh0 = paddle.ProcessMesh([[0, 1], [2, 3]], dim_names=["x", "y"])
        mesh1 = paddle.ProcessMesh([[4, 5], [6, 7]], dim_names=["x", "y"])
        np.random.seed(3)
        loader = DataLoader(GlobalDraws(), batch_sampler=BatchSampler(GlobalDraws(), batch_size=4))
        sharded = paddle.shard_dataloader(loader, meshes=[mesh0, mesh1], shard_dims="x")
        got = [[f.full_tensor() for f in b] for b in sharded()]
        assert [f.placements for f in next(iter(sharded()))] == [[paddle.Shard(0), paddle.Replicate()]] * 2
    assert len(got) == len(plain) == 2
    for g, p in zip(got, plain, strict=True):
        np.testing.assert_array_equal(g[0], p[0])
        np.testing.assert_array_equal(g[1], p[1])
