"""The captured step (``dist.compile_step(fn, capture=True)``): bit-identical to eager, or refused.

Every comparison runs the same program twice from the same initial state -- once eagerly, once
captured -- and compares the returned values and the parameters with ``np.array_equal``, in
float64, and the collectives with their full event lists. Steps the capture cannot reproduce
(a value read in Python, a per-call random key, a float returned) must be refused with a
reason and still give the eager results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi_scripts.launch import mpirun  # the MPI test launches mpiexec, as tests/mpi/test_mpi_runtime.py does
from tp_mlp_layer import MLP, comm_events, mlp_loss, mlp_parameters, mse, sharded_mlp  # tests/tp_mlp_layer.py

import mpipar as dist
from mpipar import _capture_hooks
from mpipar.compile import capture
from simulator import SimBackend

F = dist.nn.functional
Step = Callable[..., Any]


@pytest.fixture(autouse=True)
def _sim4() -> Any:
    with dist.use_backend(SimBackend(4)):
        yield


def mlp(
    layout: str = "tp", opt: str = "sgd", lr: Any = 0.01, numpy_args: bool = False, clear: bool = True
) -> tuple[Step, list[dist.Tensor], Any]:
    """Megatron's MLP (``tp``: hidden split) or a data-parallel one (``dp``: batch split), float64."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    tp = layout == "tp"
    params = mlp_parameters(mesh, tp)
    kinds = {
        "sgd": dist.optimizer.SGD,
        "momentum": dist.optimizer.Momentum,
        "adamw": dist.optimizer.AdamW,
        "adam": dist.optimizer.Adam,
    }
    optimizer = kinds[opt](learning_rate=lr, parameters=params)
    x_layout = [dist.Replicate() if tp else dist.Shard(0)]

    def step(x: Any) -> dist.Tensor:
        if numpy_args:
            x = dist.shard_tensor(x, mesh, x_layout)
        loss = mlp_loss(x, *params)
        loss.backward()
        optimizer.step()
        if clear:
            optimizer.clear_grad()
        return loss

    return step, params, optimizer


def _batches(
    n: int, rows: int | list[int] = 8, seed: int = 1, numpy_args: bool = False, layout: str = "tp"
) -> list[Any]:
    rng = np.random.default_rng(seed)
    sizes = rows if isinstance(rows, list) else [rows] * n
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    out = []
    for r in sizes:
        x = rng.standard_normal((r, 6))
        out.append(
            x if numpy_args else dist.shard_tensor(x, mesh, [dist.Replicate() if layout == "tp" else dist.Shard(0)])
        )
    return out


def _value(out: Any) -> Any:
    if isinstance(out, dist.Tensor):
        return out.full_tensor()
    if isinstance(out, (list, tuple)):
        return [_value(v) for v in out]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b, strict=True))
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(autouse=True)
def _per_gradient_reductions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured step replays each gradient's own reshard (the default 25 MiB buckets stay out of
    a capture); its eager twin here reduces per gradient too, so the two communicate alike."""
    monkeypatch.setenv("MPIPAR_GRAD_BUCKET_MIB", "off")


def _run(
    build: Callable[[], tuple[Step, list[dist.Tensor], Any]],
    batches: list[Any],
    captured: bool,
    between: Callable[[Any, int], None] | None = None,
) -> tuple[list[Any], list[np.ndarray], list[Any], Any]:
    step, params, opt = build()
    fn = dist.compile_step(step, capture=True) if captured else step
    outs, events = [], []
    for i, x in enumerate(batches):
        with dist.CommDebugMode() as comm:
            out = fn(x)
        outs.append(_value(out))
        events.append(comm_events(comm))
        if between is not None:
            between(opt, i)
    return outs, [p.full_tensor() for p in params], events, fn


def _assert_same(eager: tuple[Any, ...], captured: tuple[Any, ...]) -> None:
    for a, b in zip(eager[0], captured[0], strict=True):
        assert _same(a, b), (a, b)
    for a, b in zip(eager[1], captured[1], strict=True):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------------------- captured
@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_captured_mlp_steps_are_bit_identical_and_communicate_alike(layout: str) -> None:
    batches = _batches(6, layout=layout)
    eager = _run(lambda: mlp(layout), batches, captured=False)
    captured = _run(lambda: mlp(layout), batches, captured=True)
    _assert_same(eager, captured)
    fn = captured[3]
    assert fn.captured and fn.capture_refused is None
    assert fn.captured_calls >= 6 - capture.MAX_TRACES  # a few traced calls, then the program
    # The program makes the same collectives, in the same order, with the same sizes.
    for i in range(2, 6):
        assert captured[2][i] == eager[2][i], i
    if layout == "tp":
        assert [e[0] for e in captured[2][5]].count("all_reduce") == 1


def test_the_program_does_not_run_the_step_function() -> None:
    step, _, _ = mlp("tp")
    calls = []

    def counted(x: dist.Tensor) -> dist.Tensor:
        calls.append(1)  # a Python side effect: it runs on traced calls only
        return step(x)

    fn = dist.compile_step(counted, capture=True)
    for x in _batches(5):
        fn(x)
    assert fn.captured and len(calls) <= capture.MAX_TRACES and fn.captured_calls == 5 - len(calls)


@pytest.mark.parametrize("opt", ["momentum", "adamw", "adam"])
def test_stateful_optimizers_are_captured_with_live_step_counts(opt: str) -> None:
    batches = _batches(7)
    eager = _run(lambda: mlp("tp", opt), batches, captured=False)
    captured = _run(lambda: mlp("tp", opt), batches, captured=True)
    _assert_same(eager, captured)
    fn = captured[3]
    assert fn.captured, fn.capture_refused


def test_optimizer_states_and_counts_after_the_program_equal_eager() -> None:
    builds = [mlp("tp", "adamw") for _ in range(2)]
    fn = dist.compile_step(builds[1][0], capture=True)
    for x in _batches(6):
        builds[0][0](x)
        fn(x)
    assert fn.captured
    (_, p0, o0), (_, p1, o1) = builds
    for a, b in zip(p0, p1, strict=True):
        s0, s1 = o0._states[id(a)], o1._states[id(b)]
        assert s0["step"] == s1["step"] == 6
        for n in o0.state_names:
            assert np.array_equal(s0[n].full_tensor(), s1[n].full_tensor())
        assert b.grad is None


def test_lr_scheduler_between_steps_is_read_live() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        return mlp("tp", "sgd", lr=dist.optimizer.lr.StepDecay(0.05, step_size=2, gamma=0.5))

    def sched(opt: Any, i: int) -> None:
        opt._learning_rate.step()

    batches = _batches(8)
    eager = _run(build, batches, captured=False, between=sched)
    captured = _run(build, batches, captured=True, between=sched)
    _assert_same(eager, captured)
    assert captured[3].captured, captured[3].capture_refused


def test_a_scheduler_stepped_inside_the_step_is_refused_and_right() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp", "sgd", lr=dist.optimizer.lr.StepDecay(0.05, step_size=1, gamma=0.5))

        def step(x: dist.Tensor) -> dist.Tensor:
            loss = inner(x)
            opt._learning_rate.step()
            return loss

        return step, params, opt

    batches = _batches(5)
    eager = _run(build, batches, captured=False)
    captured = _run(build, batches, captured=True)
    _assert_same(eager, captured)
    assert not captured[3].captured and "LRScheduler" in captured[3].capture_refused


def test_numpy_arguments_are_read_live() -> None:
    batches = _batches(6, numpy_args=True)
    eager = _run(lambda: mlp("dp", numpy_args=True), batches, captured=False)
    captured = _run(lambda: mlp("dp", numpy_args=True), batches, captured=True)
    _assert_same(eager, captured)
    assert captured[3].captured, captured[3].capture_refused


def test_gradients_accumulated_across_calls_are_captured() -> None:
    """Without clear_grad the gradient held from the last call is a root of the program."""
    batches = _batches(6)
    eager = _run(lambda: mlp("tp", clear=False), batches, captured=False)
    captured = _run(lambda: mlp("tp", clear=False), batches, captured=True)
    _assert_same(eager, captured)
    assert captured[3].captured, captured[3].capture_refused


def test_shape_change_traces_each_layout() -> None:
    batches = _batches(0, rows=[8, 8, 8, 12, 12, 12, 8, 12, 8])
    eager = _run(lambda: mlp("dp"), batches, captured=False)
    captured = _run(lambda: mlp("dp"), batches, captured=True)
    _assert_same(eager, captured)
    fn = captured[3]
    assert fn.captured and len(fn._captures) == 2
    assert fn.captured_calls >= 3  # the later 8s and 12s ran the programs


def test_a_parameter_moved_makes_the_program_stale() -> None:
    step, params, _ = mlp("tp")
    fn = dist.compile_step(step, capture=True)
    ref_step, ref_params, _ = mlp("tp")
    batches = _batches(7)
    for x in batches[:4]:
        assert np.array_equal(fn(x).full_tensor(), ref_step(x).full_tensor())
    assert fn.captured
    mesh = params[0].spec.mesh
    dist.shard_tensor(params[0], mesh, [dist.Replicate()])
    dist.shard_tensor(ref_params[0], mesh, [dist.Replicate()])
    for x in batches[4:]:
        assert np.array_equal(fn(x).full_tensor(), ref_step(x).full_tensor())
    for a, b in zip(params, ref_params, strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor())


def test_python_number_arguments_are_part_of_the_key() -> None:
    """A number argument is a constant of the program: another value traces another program."""
    step, params, _ = mlp("tp")
    ref_step, ref_params, _ = mlp("tp")

    def scaled(x: dist.Tensor, factor: float) -> dist.Tensor:
        return dist.scale(step(x), factor)

    fn = dist.compile_step(scaled, capture=True)
    factors = [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0]
    for x, f in zip(_batches(len(factors)), factors, strict=True):
        assert np.array_equal(fn(x, f).full_tensor(), dist.scale(ref_step(x), f).full_tensor())
    assert fn.captured and len(fn._captures) == 2
    for a, b in zip(params, ref_params, strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor())


def test_a_closure_tensor_is_read_live() -> None:
    """A tensor the step reads from outside (not an argument) is read afresh by every run."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    c = dist.Tensor(np.ones(6))
    outs = []

    def step(x: dist.Tensor) -> dist.Tensor:
        return dist.sum(dist.multiply(x, c))

    fn = dist.compile_step(step, capture=True)
    xs = _batches(6)
    for i, x in enumerate(xs):
        c.set_value(np.full(6, float(i)))  # a new value (and storage) between calls
        outs.append((fn(x).full_tensor(), step(x).full_tensor()))
    assert fn.captured, fn.capture_refused
    for a, b in outs:
        assert np.array_equal(a, b)
    assert mesh.ndim == 1


# ------------------------------------------------------------------------------- refused
def _refused_same(build: Callable[[], tuple[Step, list[dist.Tensor], Any]], batches: list[Any], words: str) -> Any:
    dist.seed(3)
    eager = _run(build, batches, captured=False)
    dist.seed(3)
    captured = _run(build, batches, captured=True)
    _assert_same(eager, captured)
    fn = captured[3]
    assert not fn.captured and fn.captured_calls == 0
    assert fn.capture_refused is not None and words in fn.capture_refused, fn.capture_refused
    return fn


def test_a_step_returning_a_float_is_refused_and_right() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")
        return (lambda x: float(inner(x).full_tensor())), params, opt

    _refused_same(build, _batches(4), "reads a tensor's value")


def test_a_step_returning_an_array_is_refused() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")
        return (lambda x: (inner(x), np.zeros(2))), params, opt

    fn = _refused_same(build, _batches(4), "returns a ndarray")
    assert "Tensors" in fn.capture_refused


def test_python_control_flow_on_a_tensor_value_is_refused_and_right() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")

        def step(x: dist.Tensor) -> dist.Tensor:
            loss = inner(x)
            if float(loss) > 30.0:  # an extra op on some calls only
                loss = dist.scale(loss, 0.5)
            return loss

        return step, params, opt

    rng = np.random.default_rng(5)
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    batches = [
        dist.shard_tensor(rng.standard_normal((8, 6)) * s, mesh, [dist.Replicate()]) for s in (1.0, 1.0, 1.0, 3.0, 1.0)
    ]
    _refused_same(build, batches, "control flow")


def test_dropout_is_refused_and_right() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
        w = dist.shard_tensor(dist.Parameter(np.linspace(-1, 1, 36).reshape(6, 6)), mesh, [dist.Shard(1)])
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w])

        def step(x: dist.Tensor) -> dist.Tensor:
            loss = dist.mean(F.dropout(dist.matmul(x, w), p=0.5))
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        return step, [w], opt

    _refused_same(build, _batches(5), "never gave the same program")


def test_a_dense_tensor_made_inside_the_step_is_refused() -> None:
    """An array made per call by code the capture does not see differs between the traces."""

    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")
        return (lambda x: dist.add(inner(x), dist.to_tensor(np.ones(())))), params, opt

    _refused_same(build, _batches(5), "never gave the same program")


def test_a_hand_written_collective_is_refused() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")
        backend = dist.current_backend()

        def step(x: dist.Tensor) -> dist.Tensor:
            backend.comm.all_reduce((0, 1, 2, 3), {r: np.ones(2) for r in range(4)}, "sum")
            return inner(x)

        return step, params, opt

    _refused_same(build, _batches(4), "outside the reshards")


def test_a_kernel_with_a_hidden_input_fails_validation_and_stays_right() -> None:
    """A kernel reading state the capture cannot see (a counter bumped per call) makes the same
    instructions every trace, so only the validation run can tell: it must refuse."""
    from mpipar.ops.dispatch import OpDef, apply, register_op

    calls = [0]

    def drifting(ctx: Any, x: np.ndarray, **_: Any) -> np.ndarray:
        calls[0] += 1
        return x + x.dtype.type(calls[0])

    register_op(OpDef("test_capture_drift", drifting, None, rule="relu"))

    def build() -> tuple[Step, list[dist.Tensor], Any]:
        inner, params, opt = mlp("tp")
        return (lambda x: apply("test_capture_drift", [inner(x)])), params, opt

    calls[0] = 0
    eager = _run(build, _batches(5), captured=False)
    calls[0] = 0
    captured = _run(build, _batches(5), captured=True)
    # The captured run's kernel also runs in the validation, so its counter is one ahead there.
    fn = captured[3]
    assert not fn.captured and "validation run differs" in fn.capture_refused
    for a, b in zip(eager[1], captured[1], strict=True):
        assert np.array_equal(a, b)


def test_an_argument_that_requires_a_gradient_is_refused_and_right() -> None:
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])
    w = dist.shard_tensor(dist.Parameter(np.linspace(-1, 1, 36).reshape(6, 6)), mesh, [dist.Shard(1)])

    def step(x: dist.Tensor) -> dist.Tensor:
        loss = dist.mean(dist.square(dist.matmul(x, w)))
        loss.backward()
        w.clear_grad()
        return loss

    fn = dist.compile_step(step, capture=True)
    x = _batches(1)[0]
    x.stop_gradient = False  # the same input every call, its gradient wanted
    grads = []
    for _ in range(4):
        x.clear_grad()
        fn(x)
        grads.append(x.grad.full_tensor())
    assert not fn.captured and "requires a gradient" in fn.capture_refused
    x.clear_grad()
    step(x)
    assert all(np.array_equal(g, x.grad.full_tensor()) for g in grads)


def test_observers_run_the_step_eagerly() -> None:
    step, _, _ = mlp("tp")
    fn = dist.compile_step(step, capture=True)
    xs = _batches(5)
    for x in xs[:3]:
        fn(x)
    assert fn.captured
    from mpipar import hooks

    class Seen:
        def __init__(self) -> None:
            self.ops: list[str] = []

        def on_op(self, op: Any, *rest: Any) -> None:
            self.ops.append(op.name)

    seen = Seen()
    hooks.op_hooks.append(seen)
    try:
        fn(xs[3])
    finally:
        hooks.op_hooks.remove(seen)
    assert "matmul" in seen.ops and not fn.captured and "observers" in fn.capture_refused
    fn(xs[4])
    assert fn.captured  # the program is kept for when nobody watches


def test_an_optimizer_given_a_clip_after_capture_runs_eagerly() -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        return mlp("tp")

    batches = _batches(7)
    clip = dist.optimizer.ClipGradByGlobalNorm(0.01)

    def add_clip(opt: Any, i: int) -> None:
        if i == 3:
            opt._grad_clip = clip  # from the fifth call on the step clips (reading a norm in Python)

    eager = _run(build, batches, captured=False, between=add_clip)
    captured = _run(build, batches, captured=True, between=add_clip)
    _assert_same(eager, captured)
    assert not captured[3].captured and "reads a tensor's value" in captured[3].capture_refused


def test_default_compile_step_is_unchanged() -> None:
    step, _, _ = mlp("tp")
    fn = dist.compile_step(step)
    for x in _batches(3):
        fn(x)
    assert not fn.capture and not fn._captures and fn.captured_calls == 0 and fn.retraces == 1
    assert not _capture_hooks.capture_tracers


# ------------------------------------------------------------------------------- hypothesis
@settings(max_examples=8, deadline=None)
@given(
    layout=st.sampled_from(["tp", "dp"]),
    opt=st.sampled_from(["sgd", "momentum", "adamw"]),
    rows=st.lists(st.sampled_from([4, 8]), min_size=3, max_size=7),
    lr_changes=st.booleans(),
    clear=st.booleans(),
    numpy_args=st.booleans(),
)
def test_captured_equals_eager_on_random_runs(
    layout: str, opt: str, rows: list[int], lr_changes: bool, clear: bool, numpy_args: bool
) -> None:
    def build() -> tuple[Step, list[dist.Tensor], Any]:
        lr = dist.optimizer.lr.StepDecay(0.05, step_size=1, gamma=0.7) if lr_changes else 0.02
        return mlp(layout, opt, lr=lr, numpy_args=numpy_args, clear=clear)

    def sched(o: Any, i: int) -> None:
        if lr_changes:
            o._learning_rate.step()

    batches = _batches(0, rows=rows, layout=layout, numpy_args=numpy_args)
    eager = _run(build, batches, captured=False, between=sched)
    captured = _run(build, batches, captured=True, between=sched)
    _assert_same(eager, captured)
    fn = captured[3]
    assert fn.capture_refused is None, fn.capture_refused  # nothing here is refused: traced or captured
    # Every call made the eager step's collectives: traced (the validation run's are not heard) or captured.
    assert eager[2] == captured[2]


# ------------------------------------------------------------------------------- in place
def _one_rank_sgd() -> tuple[Step, list[dist.Tensor], Any]:
    """A mesh of one rank: each parameter has one shard, which SGD may overwrite in place."""
    mesh = dist.ProcessMesh([0], dim_names=["x"])
    rng = np.random.default_rng(2)
    w = dist.shard_tensor(dist.Parameter(rng.standard_normal((6, 5))), mesh, [dist.Replicate()])
    b = dist.shard_tensor(dist.Parameter(rng.standard_normal(5)), mesh, [dist.Replicate()])
    opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w, b])

    def step(x: Any) -> dist.Tensor:
        loss = dist.mean(dist.square(dist.add(dist.matmul(dist.shard_tensor(x, mesh, [dist.Replicate()]), w), b)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        return loss

    return step, [w, b], opt


def test_sgd_program_overwrites_lone_weights_in_place_and_stays_exact() -> None:
    batches = _batches(7, numpy_args=True)
    eager = _run(_one_rank_sgd, batches, captured=False)
    captured = _run(_one_rank_sgd, batches, captured=True)
    _assert_same(eager, captured)
    program = next(c.program for c in captured[3]._captures.values() if c.program is not None)
    assert program.alone_flags and all(program.alone_flags)


def test_a_weight_shard_held_elsewhere_is_never_overwritten() -> None:
    step, params, _ = _one_rank_sgd()
    fn = dist.compile_step(step, capture=True)
    batches = _batches(6, numpy_args=True)
    for x in batches[:4]:
        fn(x)
    assert fn.captured
    held = params[0].local_tensor()  # the user keeps the current shard: it must not change
    before = held.copy()
    fn(batches[4])
    program = next(c.program for c in fn._captures.values() if c.program is not None)
    assert not program.alone_flags[0]
    assert np.array_equal(held, before)
    assert not np.array_equal(params[0].local_tensor(), before)  # the weight itself did move


# ------------------------------------------------------------------------------- MPI
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_captured_steps_under_mpi_match_eager(n: int) -> None:
    """TP MLP (SGD in place, AdamW) and a DP MLP: losses, weights, states and collectives."""
    run = mpirun(
        n,
        "tests/mpi_scripts/capture_step.py",
        "--steps",
        "8",
        env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MPIPAR_GRAD_BUCKET_MIB": "off"},
    )
    assert run.returncode == 0, run.output[-4000:]
    for r in range(n):
        lines = run.lines_of(r)
        for case in ("tp-sgd", "tp-adamw", "dp-sgd"):
            assert any(line.startswith(f"ok {case} captured ") for line in lines), run.output[-3000:]


@pytest.mark.mpi
def test_the_bound_all_reduce_equals_the_general_one_under_mpi() -> None:
    """A captured program's all-reduce (``MPICommunicator.bound_all_reduce``): the same bits as
    ``all_reduce`` for every dtype, op and shape, on the world and on a subgroup."""
    run = mpirun(4, "tests/mpi_scripts/bound_all_reduce.py", env={"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.output[-4000:]
    assert [line for line in run.lines_of(0) if line.startswith("ok bound ")] == ["ok bound 72"], run.output[-3000:]
    for r in range(1, 4):
        assert any(line.startswith("ok bound ") for line in run.lines_of(r)), run.output[-3000:]


def test_to_static_captures_its_training_steps() -> None:
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])

    def build() -> tuple[MLP, Any]:
        return sharded_mlp(mesh, dist.optimizer.Momentum)

    loss_fn = mse

    rng = np.random.default_rng(2)
    data = [
        tuple(dist.shard_tensor(rng.standard_normal((8, 6)), mesh, [dist.Replicate()]) for _ in range(2))
        for _ in range(6)
    ]
    m1, o1 = build()
    m2, o2 = build()
    plain = dist.to_static(m1, None, loss_fn, o1)
    captured = dist.to_static(m2, None, loss_fn, o2, capture=True)
    for x, y in data:
        assert np.array_equal(plain(x, y).full_tensor(), captured(x, y).full_tensor())
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert np.array_equal(a.full_tensor(), b.full_tensor())
    assert captured.replay.captured and captured.replay.captured_calls > 0, captured.replay.capture_refused
    assert not plain.replay.capture


def test_a_pipelined_to_static_model_runs_as_before() -> None:
    """A pipeline schedule's stage runs and hand-offs are not captured: refused, same losses."""
    meshes = dist.ProcessMesh([0, 1], dim_names=["dp"]), dist.ProcessMesh([2, 3], dim_names=["dp"])

    class TwoStage(dist.nn.Layer):
        def __init__(self) -> None:
            super().__init__(dtype="float64")
            with dist.nn.layer.default_dtype("float64"):
                self.a = dist.nn.Linear(6, 12)
                self.b = dist.nn.Linear(12, 3)
            dist.shard_layer(self.a, meshes[0])
            dist.shard_layer(self.b, meshes[1])

        def forward(self, x: dist.Tensor) -> dist.Tensor:
            return self.b(dist.reshard(F.relu(self.a(x)), meshes[1], [dist.Shard(0)]))

    def train(capture_steps: bool) -> tuple[list[float], Any]:
        dist.seed(3)
        model = TwoStage()
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
        strategy = dist.Strategy({"pipeline": {"enable": True, "schedule_mode": "1F1B", "accumulate_steps": 2}})
        dm = dist.to_static(
            model,
            None,
            lambda out, y: dist.mean(dist.square(dist.subtract(out, y))),
            opt,
            strategy,
            capture=capture_steps,
        )
        losses = []
        for step in range(4):
            rng = np.random.default_rng(step)
            x = dist.shard_tensor(rng.standard_normal((8, 6)), meshes[0], [dist.Shard(0)])
            y = dist.shard_tensor(rng.standard_normal((8, 3)), meshes[1], [dist.Shard(0)])
            losses.append(float(dm(x, y)))
        return losses, dm

    plain, _ = train(False)
    captured, dm = train(True)
    assert plain == captured
    assert not dm.replay.captured and dm.replay.capture_refused, dm.replay.capture_refused


def test_compile_step_as_a_decorator_with_capture() -> None:
    step, _, _ = mlp("tp")

    @dist.compile_step(capture=True)
    def train_step(x: dist.Tensor) -> dist.Tensor:
        return step(x)

    for x in _batches(5):
        train_step(x)
    assert isinstance(train_step, dist.CompiledStep) and train_step.capture and train_step.captured


# ------------------------------------------------------------------------------- the program's own savings
def _program_of(fn: Any) -> Any:
    return next(c.program for c in fn._captures.values() if c.program is not None)


def _name(f: Any) -> str:
    while hasattr(f, "func"):  # a partial; an update allowed to write in place wraps the update
        f = f.args[0] if f.func is capture.write_in_place else f.func
    return getattr(f, "__name__", repr(f))


def test_a_repeated_product_is_made_once() -> None:
    """A step that computes the same product twice (``x * w`` written two times): the captured
    program makes it once and reads it for the repeat (``same_once``), bit-identical to eager."""
    mesh = dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])

    def build() -> tuple[Step, list[dist.Tensor], Any]:
        w = dist.shard_tensor(dist.Parameter(np.linspace(0.5, 1.5, 6)), mesh, [dist.Replicate()])
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w])

        def step(x: dist.Tensor) -> dist.Tensor:
            u = dist.multiply(x, w)
            v = dist.multiply(x, w)
            loss = dist.mean(dist.add(u, v))
            loss.backward()
            opt.step()
            opt.clear_grad()
            return loss

        return step, [w], opt

    batches = _batches(5)
    eager = _run(build, batches, captured=False)
    captured = _run(build, batches, captured=True)
    _assert_same(eager, captured)
    assert _program_of(captured[3]).alias


def test_the_seed_of_backward_is_folded_and_updates_follow_their_gradients() -> None:
    """The TP MLP's program: the seed of backward and its scaling, reshape and broadcast are
    constants (read-only, no instruction makes them), and every SGD update runs right after the instruction that makes its gradient, not after the
    whole backward; still bit-identical."""
    batches = _batches(5)
    eager = _run(lambda: mlp("tp"), batches, captured=False)
    captured = _run(lambda: mlp("tp"), batches, captured=True)
    _assert_same(eager, captured)
    program = _program_of(captured[3])
    names = [_name(fn) for fn, _, _, _ in program.instrs]
    assert "_fill_fn" not in names and "_expand_kernel" not in names, names
    folded = [a for a in program.template if isinstance(a, np.ndarray)]
    assert folded and not any(a.flags.writeable for a in folded)
    # the backward of z * z makes its one product once in eager already (``_mul_grad``): the
    # capture has no repeat to fold here (``test_a_repeated_product_is_made_once`` has one)
    makers = {}
    for k, (_, _, outs, kind) in enumerate(program.instrs):
        for s in (outs,) if kind == 0 else outs if kind == 1 else ():
            makers[s] = k
    updates = [k for k, name in enumerate(names) if name in ("_update_fn", "_sgd_fn")]
    assert len(updates) == 16  # four parameters on four ranks
    for k in updates:
        grad = program.instrs[k][1][1]
        assert makers[grad] < k
        between = [names[j] for j in range(makers[grad] + 1, k)]
        assert all(n in ("_update_fn", "_sgd_fn") for n in between), between  # only other updates in between
    assert (
        names[-4:] == ["_bump_fn"] * 4 and names.count("_bump_fn") == 4
    )  # the step counts (one a parameter) stay last


def test_only_mpipars_own_kernels_are_folded() -> None:
    """A user's kernel may read state the capture cannot see: never a constant of the program."""
    from mpipar.ops.dispatch import OpDef, get_op, register_op

    register_op(OpDef("test_capture_user_kernel", lambda c, x, **_: x, None, rule="relu"))
    assert not capture.builtin_kernel(get_op("test_capture_user_kernel"))
    assert capture.builtin_kernel(get_op("add")) and capture.builtin_kernel(get_op("expand"))


def test_an_update_in_place_stays_after_every_read_of_its_weight() -> None:
    """On a one-rank mesh SGD overwrites the weight in place. The step reads the weight again
    after its gradient is made (``after``): the update may move up to its gradient but no
    further than that read, or ``after`` would see the new weight."""
    mesh = dist.ProcessMesh([0], dim_names=["x"])

    def build() -> tuple[Step, list[dist.Tensor], Any]:
        rng = np.random.default_rng(3)
        w = dist.shard_tensor(dist.Parameter(rng.standard_normal((6, 5))), mesh, [dist.Replicate()])
        opt = dist.optimizer.SGD(learning_rate=0.1, parameters=[w])

        def step(x: dist.Tensor) -> tuple[dist.Tensor, dist.Tensor]:
            loss = dist.mean(dist.square(dist.matmul(x, w)))
            loss.backward()
            after = dist.matmul(x, w)  # the weight read again, its gradient already made
            opt.step()
            opt.clear_grad()
            return loss, after

        return step, [w], opt

    rng = np.random.default_rng(4)
    batches = [dist.shard_tensor(rng.standard_normal((4, 6)), mesh, [dist.Replicate()]) for _ in range(6)]
    eager = _run(build, batches, captured=False)
    captured = _run(build, batches, captured=True)
    _assert_same(eager, captured)
    fn = captured[3]
    assert fn.captured, fn.capture_refused
    program = _program_of(fn)
    assert program.alone_flags == [True]  # the update did write in place
    names = [_name(f) for f, _, _, _ in program.instrs]
    update = names.index("_sgd_fn")
    weight = program.instrs[update][1][0]
    readers = [k for k, (_, ins, _, _) in enumerate(program.instrs) if weight in ins and k != update]
    assert readers and max(readers) < update
