"""Paddle's static graph (``mpipar.static``), its graph dump (``mpipar.base``) and ``dist.Engine``.

The oracle is eager mpipar: a static program is the recorded graph of the same ops, so its
losses equal the eager step's bit for bit; an Engine's (data parallel, ZeRO 2 and 3, recompute,
gradient merge) equal one device's within float64 rounding. Misuse stops with a named error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as paddle
import mpipar.distributed as dist
from mpipar.base import core
from mpipar.base.framework import IrGraph
from mpipar.compile.program import Program, program_guard
from simulator import SimBackend


class Net(paddle.nn.Layer):
    def __init__(self, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.linear1 = paddle.nn.Linear(d_in, hidden)
        self.linear2 = paddle.nn.Linear(hidden, classes)
        self.relu = paddle.nn.ReLU()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.relu(self.linear2(self.linear1(x)))


def _batches(n: int, batch: int, d_in: int, classes: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((batch, d_in)), rng.integers(0, classes, (batch, 1)).astype("int64")) for _ in range(n)
    ]


def _momentum(params: list[paddle.Tensor] | None) -> paddle.optimizer.Optimizer:
    return paddle.optimizer.Momentum(
        learning_rate=0.1, momentum=0.9, weight_decay=paddle.regularizer.L2Decay(1e-4), parameters=params
    )


def _eager(batches: list[tuple[np.ndarray, np.ndarray]], d_in: int, hidden: int, classes: int) -> list[float]:
    paddle.seed(7)
    model = Net(d_in, hidden, classes)
    opt = _momentum(model.parameters())
    out = []
    for x, y in batches:
        loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        loss.backward()
        opt.step()
        opt.clear_grad()
        out.append(float(loss))
    return out


@pytest.fixture
def static_mode() -> Iterator[None]:
    paddle.enable_static()
    try:
        yield
    finally:
        paddle.disable_static()


def _build(d_in: int, hidden: int, classes: int) -> tuple[Program, paddle.Tensor, paddle.Tensor]:
    paddle.seed(7)
    model = Net(d_in, hidden, classes)
    opt = _momentum(None)  # static mode: the program's parameters, at minimize
    main = Program()
    with program_guard(main, Program(startup=True)):
        img = paddle.static.data(name="img", shape=[None, d_in], dtype="float64")
        label = paddle.static.data(name="label", shape=[None, 1], dtype="int64")
        out = model(img)
        loss = paddle.nn.functional.cross_entropy(input=out, label=label)
        acc = paddle.metric.accuracy(input=out, label=label, k=1)
        opt.minimize(loss)
    return main, loss, acc


@settings(max_examples=4)
@given(batch=st.integers(1, 6), hidden=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_static_program_losses_equal_the_eager_steps(batch: int, hidden: int, seed: int) -> None:
    d_in, classes = 5, 4
    batches = _batches(3, batch, d_in, classes, seed)
    want = _eager(batches, d_in, hidden, classes)
    paddle.enable_static()
    try:
        main, loss, acc = _build(d_in, hidden, classes)
        exe = paddle.static.Executor(paddle.CPUPlace())
        assert exe.run(paddle.static.default_startup_program()) == []
        got = []
        for x, y in batches:
            lv, av = exe.run(main, feed={"img": x, "label": y}, fetch_list=[loss.name, acc])
            got.append(float(lv))
            assert 0.0 <= float(av) <= 1.0
    finally:
        paddle.disable_static()
    assert got == want  # bit for bit: the same ops in the same order


def test_static_program_refuses_bad_feeds_and_fetches(static_mode: None) -> None:
    main, loss, _ = _build(3, 4, 2)
    exe = paddle.static.Executor(paddle.CUDAPlace(0))
    x, y = np.zeros((2, 3)), np.zeros((2, 1), dtype="int64")
    with pytest.raises(TypeError, match=r"feed 'img' has dtype float32, but static\.data declared float64"):
        exe.run(main, feed={"img": x.astype("float32"), "label": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match=r"feed 'img' has shape \[2, 4\], but static.data declared \[-1, 3\]"):
        exe.run(main, feed={"img": np.zeros((2, 4)), "label": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match=r"feed is missing \['label'\]"):
        exe.run(main, feed={"img": x}, fetch_list=[loss])
    with pytest.raises(ValueError, match=r"no data named \['lbl'\]"):
        exe.run(main, feed={"img": x, "label": y, "lbl": y}, fetch_list=[loss])
    with pytest.raises(ValueError, match="no variable named 'nope'"):
        exe.run(main, feed={"img": x, "label": y}, fetch_list=["nope"])
    with pytest.raises(NotImplementedError, match=r"paddle.static.CompiledProgram is not supported"):
        paddle.static.CompiledProgram(main)
    with pytest.raises(NotImplementedError, match=r"paddle.static.nn.fc is not supported"):
        paddle.static.nn.fc(None, 3)


def test_static_data_and_parameterless_optimizers_need_static_mode() -> None:
    with pytest.raises(ValueError, match=r"call mpipar\.enable_static"):
        paddle.static.data(name="x", shape=[None, 2])
    with pytest.raises(ValueError, match="needs parameters="):
        _momentum(None)


def test_program_prints_and_draws_its_ops(static_mode: None, tmp_path: str) -> None:
    main, _, _ = _build(3, 4, 2)
    text = str(main)
    for needed in ("img : float64 [-1, 3]", "matmul(img, net.linear1.weight)", "ops (backward)", "Momentum update"):
        assert needed in text, text
    written = IrGraph(core.Graph(main.desc), for_test=True).draw(str(tmp_path), "single_main_program", [])
    with open(written[0], encoding="utf-8") as f:
        dot = f.read()
    assert written[0].endswith("single_main_program.dot") and dot.startswith('digraph "main program"')
    assert dot.count("shape=box") >= 8 and "cross_entropy_with_softmax" in dot
    assert all(os.path.exists(p) for p in written)


# --------------------------------------------------------------------------- Engine
class _Data(paddle.io.Dataset):
    def __init__(self, n: int, d_in: int, classes: int) -> None:
        rng = np.random.default_rng(3)
        self.x = rng.standard_normal((n, d_in))
        self.y = rng.integers(0, classes, (n, 1)).astype("int64")

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return len(self.x)


@pytest.fixture
def float64() -> Iterator[None]:
    saved = paddle.get_default_dtype()
    paddle.set_default_dtype("float64")
    try:
        yield
    finally:
        paddle.set_default_dtype(saved)


def _engine_losses(
    strategy: dist.auto_parallel.Strategy, world: int, steps: int = 3
) -> tuple[list[float], dist.Engine]:
    with paddle.use_backend(SimBackend(world)):
        paddle.seed(7)
        model = Net(6, 8, 4)
        engine = dist.Engine(
            model,
            paddle.nn.CrossEntropyLoss(),
            _momentum(model.parameters()),
            paddle.metric.Accuracy(topk=(1, 2)),
            strategy=strategy,
        )
        engine.prepare(
            paddle.static.InputSpec([None, 6], "float64", "x"), paddle.static.InputSpec([None, 1], "int64", "y")
        )
        loader = engine.dataloader(_Data(8 * steps, 6, 4), batch_size=8, mode="train")
        losses = []
        for data in loader():
            outs = engine.run(data, mode="train")
            assert set(outs) == {"loss", "acc_top1", "acc_top2"}
            losses.append(engine.last_loss)
        return losses, engine


def _strategy(**sections: dict[str, object]) -> dist.auto_parallel.Strategy:
    s = dist.auto_parallel.Strategy()
    for name, values in sections.items():
        for k, v in values.items():
            setattr(getattr(s, name), k, v)
    return s


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"sharding": {"enable": True, "stage": 2, "degree": 2}},
        {"sharding": {"enable": True, "stage": 3, "degree": 2}},
        {"recompute": {"enable": True}},
        {"gradient_merge": {"enable": True, "k_steps": 2}},
    ],
    ids=["dp", "zero2", "zero3", "recompute", "gradient_merge"],
)
def test_engine_strategies_train_as_one_device(sections: dict[str, dict[str, object]], float64: None) -> None:
    one, _ = _engine_losses(dist.auto_parallel.Strategy(), 1)
    got, _ = _engine_losses(_strategy(**sections), 2)
    # float64; gradients summed over 2 ranks (or micro-batches) in another order than on one: rounding only
    np.testing.assert_allclose(got, one, rtol=1e-12)


def test_engine_data_parallel_program_shows_the_gradient_all_reduce(tmp_path: str) -> None:
    _, engine = _engine_losses(dist.auto_parallel.Strategy(), 2, steps=1)
    plan = engine.main_program.plan()
    reduces = [s for r in plan.reshards if r.phase == "backward" for s in r.steps if s.kind == "all_reduce"]
    assert len(reduces) == 4  # one per parameter gradient: 2 weights, 2 biases
    assert "all_reduce" in str(engine.main_program) and "all_reduce" not in str(engine.serial_main_program)
    written = IrGraph(core.Graph(engine.main_program.desc)).draw(str(tmp_path), "dp_main_program", [])
    with open(written[0], encoding="utf-8") as f:
        assert "all_reduce(dp)" in f.read()


def test_engine_refuses_by_name() -> None:
    with pytest.raises(ValueError, match=r"Strategy.amp.enable = True .* not supported"):
        dist.Engine(Net(2, 2, 2), strategy=_strategy(amp={"enable": True}))
    with pytest.raises(ValueError, match=r"gradient_merge.avg = False"):
        dist.Engine(Net(2, 2, 2), strategy=_strategy(gradient_merge={"enable": True, "avg": False}))
    with paddle.use_backend(SimBackend(2)):
        engine = dist.Engine(
            Net(6, 8, 4), paddle.nn.CrossEntropyLoss(), None, strategy=_strategy(sharding={"enable": True, "degree": 4})
        )
        with pytest.raises(ValueError, match=r"sharding.degree = 4, but data parallelism spans the world of 2"):
            engine.run([np.zeros((4, 6)), np.zeros((4, 1), dtype="int64")], mode="eval")


def test_engine_fit_evaluate_predict() -> None:
    with paddle.use_backend(SimBackend(2)):
        paddle.seed(7)
        model = Net(6, 8, 4)
        engine = dist.Engine(
            model, paddle.nn.CrossEntropyLoss(), _momentum(model.parameters()), paddle.metric.Accuracy()
        )
        history = engine.fit(_Data(16, 6, 4), batch_size=4, epochs=2, log_freq=0, verbose=0)
        assert len(history["loss"]) == 8 and len(history["acc_top1"]) == 2
        result = engine.evaluate(_Data(8, 6, 4), batch_size=4, verbose=0)
        assert set(result) == {"loss", "acc_top1"} and np.isfinite(result["loss"])
        preds = engine.predict(_Data(8, 6, 4), batch_size=4)
        assert len(preds) == 2 and preds[0][0].shape == (4, 4)


def test_static_program_with_placements_runs_data_parallel(float64: None) -> None:
    """shard_tensor / reshard on placeholders are recorded: the program runs data parallel over
    2 ranks, its losses equal one eager device's, and each step all-reduces the 4 gradients
    (and the fetched loss, which the mean leaves Partial)."""
    batches = _batches(3, 4, 5, 3, 1)
    want = _eager(batches, 5, 6, 3)
    with paddle.use_backend(SimBackend(2)):
        mesh = paddle.ProcessMesh([0, 1], dim_names=["dp"])
        paddle.enable_static()
        try:
            paddle.seed(7)
            model, opt, main = Net(5, 6, 3), _momentum(None), Program()
            with program_guard(main):
                img = paddle.static.data("img", [None, 5], "float64")
                label = paddle.static.data("label", [None, 1], "int64")
                x = paddle.shard_tensor(img, mesh, [paddle.Shard(0)])
                y = paddle.reshard(label, mesh, [paddle.Shard(0)])
                loss = paddle.nn.functional.cross_entropy(model(x), y)
                opt.minimize(loss)
            exe = paddle.static.Executor()
            with paddle.CommDebugMode() as comm:
                got = [float(exe.run(main, feed={"img": a, "label": b}, fetch_list=[loss])[0]) for a, b in batches]
        finally:
            paddle.disable_static()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert comm.counts() == {"all_reduce": 15}
    assert "all_reduce     over dp     P(sum) -> R" in str(main)


def test_engine_save_and_load_resume_the_same_losses(float64: None, tmp_path: str) -> None:
    def engine() -> dist.Engine:
        paddle.seed(7)
        model = Net(6, 8, 4)
        return dist.Engine(model, paddle.nn.CrossEntropyLoss(), _momentum(model.parameters()))

    data = _Data(32, 6, 4)
    with paddle.use_backend(SimBackend(2)):
        first = engine()
        batches = list(first.dataloader(data, batch_size=8)())
        for b in batches[:2]:
            first.run(b)
        first.save(str(tmp_path / "ckpt"))
        want = [first.run(b)["loss"] for b in batches[2:]]
        second = engine()
        with pytest.raises(ValueError, match="no states to fill before its first step"):
            second.load(str(tmp_path / "ckpt"))
        second.run(batches[0])  # states exist from here on; load overwrites them and the weights
        second.load(str(tmp_path / "ckpt"))
        assert [second.run(b)["loss"] for b in batches[2:]] == want


def test_clone_for_test_runs_forward_only(static_mode: None) -> None:
    main, loss, _ = _build(3, 4, 2)
    test_program = main.clone(for_test=True)
    exe = paddle.static.Executor()
    x, y = np.ones((2, 3)), np.zeros((2, 1), dtype="int64")
    a = exe.run(test_program, feed={"img": x, "label": y}, fetch_list=[loss])[0]
    b = exe.run(test_program, feed={"img": x, "label": y}, fetch_list=[loss])[0]
    c = exe.run(main, feed={"img": x, "label": y}, fetch_list=[loss])[0]
    d = exe.run(test_program, feed={"img": x, "label": y}, fetch_list=[loss])[0]
    assert a == b == c != d  # the test program updates nothing; the main program does


class _NumpyRandomData(paddle.io.Dataset):
    """Seed 003's dataset: each sample drawn from NumPy's global generator when read."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return np.random.random([6]), np.random.randint(0, 3, (1,)).astype("int64")

    def __len__(self) -> int:
        return 24


def _to_static_losses(show: bool, tmp_path: str) -> list[float]:
    """Seed 003 §2.2.4.2.5's shape: to_static with the batch marked Shard(0) in forward; with
    ``show``, its programs printed and drawn before training, as the seed's commented lines do."""
    with paddle.use_backend(SimBackend(2)):
        mesh = paddle.ProcessMesh([0, 1], dim_names=["dp"])

        class DPNet(Net):
            def forward(self, x: paddle.Tensor) -> paddle.Tensor:
                return super().forward(paddle.shard_tensor(x, mesh, [paddle.Shard(0)]))

        np.random.seed(5)
        paddle.seed(7)
        model = DPNet(6, 8, 3)
        loader = paddle.io.DataLoader(_NumpyRandomData(), batch_size=8)
        dist_model = paddle.to_static(model, loader, paddle.nn.CrossEntropyLoss(), _momentum(model.parameters()))
        if show:
            serial, main = str(dist_model._engine.serial_main_program), str(dist_model._engine.main_program)
            assert "matmul" in serial and "all_reduce" not in serial and "all_reduce" in main
            path = IrGraph(core.Graph(dist_model._engine.main_program.desc), for_test=True).draw(tmp_path, "d2s", [])[0]
            with open(path, encoding="utf-8") as f:
                assert "all_reduce(dp)" in f.read()
        return [float(dist_model(img, label)) for img, label in loader()]


def test_to_static_programs_print_before_training_without_changing_it(float64: None, tmp_path: str) -> None:
    assert _to_static_losses(True, str(tmp_path)) == _to_static_losses(False, str(tmp_path))
