"""``apply``'s short path (``mpipar.ops.dispatch``): an op call in a process hosting one rank of
its mesh (every op under MPI) whose layouts were decided before runs the cached decision's
kernel and tape record directly. It must compute exactly what the general path computes.

Each case trains the same model for a few steps twice on a backend hosting one rank: once as
is (the short path taken wherever it applies), once with a do-nothing op-start hook installed
(any listener sends every call down the general path). Losses, gradients, parameters and
optimizer states must agree bit for bit, the tapes must hold the same ops, and the first run
must actually have taken the short path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
import small_graph
from hypothesis import given
from hypothesis import strategies as st

import mpipar as dist
from mpipar import _capture_hooks, _tape, backward_replay, hooks
from mpipar.mesh import ProcessMesh
from mpipar.ops import dispatch
from simulator import SimBackend
from simulator.virtual_comm import VirtualCommunicator


@pytest.fixture(autouse=True)
def _every_backward_op_dispatched() -> Iterator[None]:
    """Backward ops through dispatch (a replayed pass runs its kernels without it, and one being
    recorded takes the general path): the paths compared here are the op calls'."""
    before = backward_replay.backward_replay_enabled()
    backward_replay.set_backward_replay(False)
    try:
        yield
    finally:
        backward_replay.set_backward_replay(before)


class _Listening:
    """An op-start hook that does nothing: its presence alone routes calls to the general path."""

    def on_op_start(self, name: str) -> None:
        pass


def _train(seed: int, dtype: type, trans_y: bool, optimizer: str, general: bool) -> tuple[list[bytes], list[str]]:
    """Three steps of a small MLP on a one-rank mesh; every value as bytes, and the backward ops."""
    rng = np.random.default_rng(seed)
    b, n_in, hidden = 3, 4, 6
    x_v = rng.standard_normal((b, n_in)).astype(dtype)
    w1_v = rng.standard_normal((n_in, hidden)).astype(dtype)
    b1_v = rng.standard_normal(hidden).astype(dtype)
    w2_v = rng.standard_normal((n_in, hidden) if trans_y else (hidden, n_in)).astype(dtype)
    b2_v = rng.standard_normal(n_in).astype(dtype)
    out: list[bytes] = []
    ops: list[str] = []
    listener = _Listening()
    with dist.use_backend(SimBackend(1)):
        mesh = ProcessMesh([0], dim_names=["mp"])
        x = dist.shard_tensor(x_v, mesh, [dist.Replicate()])
        w1 = dist.shard_tensor(dist.Parameter(w1_v), mesh, [dist.Shard(1)])
        b1 = dist.shard_tensor(dist.Parameter(b1_v), mesh, [dist.Shard(0)])
        w2 = dist.shard_tensor(dist.Parameter(w2_v), mesh, [dist.Shard(1 if trans_y else 0)])
        b2 = dist.shard_tensor(dist.Parameter(b2_v), mesh, [dist.Replicate()])
        params = [w1, b1, w2, b2]
        if optimizer == "sgd":
            opt: Any = dist.optimizer.SGD(learning_rate=0.05, parameters=params)
        else:
            opt = dist.optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=params)
        if general:
            hooks.op_start_hooks.append(listener)
        try:
            for _ in range(3):
                h = dist.nn.functional.relu(dist.add(dist.matmul(x, w1), b1))
                z = dist.add(dist.matmul(h, w2, transpose_y=trans_y), b2)
                loss = dist.add(dist.mean(dist.multiply(z, z)), dist.sum(dist.scale(h, 0.5)))
                ops.append(loss._grad_fn.op)
                loss.backward()
                out.append(loss.full_tensor().tobytes())
                out += [p.grad.full_tensor().tobytes() for p in params]
                opt.step()
                opt.clear_grad()
                out += [p.full_tensor().tobytes() for p in params]
            for state in opt._states.values():
                out += [v.full_tensor().tobytes() for k, v in sorted(state.items()) if isinstance(v, dist.Tensor)]
        finally:
            if general:
                hooks.op_start_hooks.remove(listener)
    return out, ops


@contextlib.contextmanager
def _counting_general() -> Iterator[list[str]]:
    """The op calls that take the general path inside the block, in order."""
    calls: list[str] = []
    inner: Callable[..., Any] = dispatch._apply

    def counting(name: str, inputs: Any, attrs: Any) -> Any:
        calls.append(name)
        return inner(name, inputs, attrs)

    dispatch._apply = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dispatch._apply = inner  # type: ignore[assignment]


@pytest.fixture
def general_calls() -> Iterator[list[str]]:
    with _counting_general() as calls:
        yield calls


def _listening() -> list[str]:
    """What would send every call down the general path in this process."""
    found = {
        "op start hooks": hooks.op_start_hooks,
        "op hooks": hooks.op_hooks,
        "program hooks": hooks.program_hooks,
        "pipeline stage runs": hooks.stage_runs,
        "capture tracers": _capture_hooks.capture_tracers,
        "replays": dispatch._replaying,
    }
    return [f"{name}: {items!r}" for name, items in found.items() if items]


@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float32, np.float64]),
    trans_y=st.booleans(),
    optimizer=st.sampled_from(["sgd", "momentum"]),
)
def test_short_path_matches_the_general_path(seed: int, dtype: type, trans_y: bool, optimizer: str) -> None:
    assert not _listening(), f"an earlier test left listeners installed: {_listening()}"
    with _counting_general() as calls:
        short, short_ops = _train(seed, dtype, trans_y, optimizer, general=False)
    taken_general = len(calls)
    with _counting_general() as calls:
        long, long_ops = _train(seed, dtype, trans_y, optimizer, general=True)
    every_call = len(calls)
    assert short_ops == long_ops
    assert len(short) == len(long)
    for i, (a, b) in enumerate(zip(short, long, strict=True)):
        assert a == b, f"value {i} differs between the short and the general path"
    # The general run sends every call down the general path; the first run decided each layout
    # once (its first step) and took the short path for most calls after that.
    assert taken_general < every_call / 2, (taken_general, every_call)


def test_a_new_layout_is_decided_on_the_general_path(general_calls: list[str]) -> None:
    """A call whose key was never decided goes to the general path, then the short path."""
    with dist.use_backend(SimBackend(1)):
        mesh = ProcessMesh([0], dim_names=["mp"])
        a = dist.shard_tensor(np.arange(6.0).reshape(2, 3), mesh, [dist.Shard(0)])
        b = dist.shard_tensor(np.ones((2, 3)), mesh, [dist.Shard(0)])
        general_calls.clear()
        first = dist.add(a, b)
        assert general_calls == ["add"]
        again = dist.add(a, b)
        assert general_calls == ["add"]  # the same key: decided once, then the short path
        assert np.array_equal(first.full_tensor(), again.full_tensor())
        c = dist.shard_tensor(np.ones((2, 3), dtype=np.float32), mesh, [dist.Shard(0)])
        mixed = dist.add(a, c)  # another dtype: another key, decided afresh
        assert general_calls == ["add", "add"]
        assert mixed.dtype == np.float64
        assert np.array_equal(mixed.full_tensor(), np.arange(6.0).reshape(2, 3) + 1)


def test_an_attribute_of_another_type_is_decided_afresh(general_calls: list[str]) -> None:
    """The short path's key holds each attribute's type, as the general path's does: ``[1]``
    and ``(1,)`` are equal values to Python's ``==`` on their items, not the same key."""
    with dist.use_backend(SimBackend(1)):
        mesh = ProcessMesh([0], dim_names=["mp"])
        a = dist.shard_tensor(np.arange(6.0).reshape(2, 3), mesh, [dist.Shard(0)])
        general_calls.clear()
        for axis in ([1], [1], (1,), (1,)):
            got = dispatch.apply("sum", [a], {"axis": axis, "keepdim": False})
            assert np.array_equal(got.full_tensor(), np.arange(6.0).reshape(2, 3).sum(1))
        assert general_calls == ["sum", "sum"]  # each type decided once, then the short path


class _StandInComm(VirtualCommunicator):
    """The all-reduce of a process hosting one member: every member is taken to hold this buffer
    (what the other members hold does not matter here: both paths get the same answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.all_reduces = 0

    def _all_reduce(self, group: tuple[int, ...], bufs: Mapping[int, Any], op: str) -> dict[int, Any]:
        assert op == "sum"
        self.all_reduces += 1
        return {r: a * len(group) for r, a in bufs.items()}


class _RankZeroOfTwo(SimBackend):
    """Hosts rank 0 of a two-rank mesh only, as an MPI process does: a Partial sum is real."""

    def __init__(self) -> None:
        super().__init__(2)
        self.stand_in = self._comm = _StandInComm()

    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        return (0,) if 0 in mesh.process_ids else ()


def _row_parallel_steps(general: bool) -> tuple[list[list[str]], list[bytes], list[int]]:
    """Three steps of a row-parallel matmul's Partial sum plus a replicated bias, squared and
    summed, on rank 0 of two: the bias is resharded to Partial (a local step), the sum
    all-reduced once and reused for the second operand. Per step: the calls that took the
    general path, then every value as bytes, and the all-reduces made."""
    rng = np.random.default_rng(7)
    h_v, w_v, b_v = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    backend = _RankZeroOfTwo()
    listener = _Listening()
    calls_per_step: list[list[str]] = []
    values: list[bytes] = []
    all_reduces: list[int] = []
    with dist.use_backend(backend), _counting_general() as calls:
        mesh = ProcessMesh([0, 1], dim_names=["mp"])
        h = dist.shard_tensor(h_v, mesh, [dist.Shard(1)])
        w = dist.shard_tensor(dist.Parameter(w_v), mesh, [dist.Shard(0)])
        b = dist.shard_tensor(dist.Parameter(b_v), mesh, [dist.Replicate()])
        if general:
            hooks.op_start_hooks.append(listener)
        try:
            for _ in range(3):
                calls.clear()
                before = backend.stand_in.all_reduces
                z = dist.add(dist.matmul(h, w), b)
                assert z.spec.placements[0].is_partial()  # the bias went to the sum's layout
                zz = dist.multiply(z, z)
                assert not zz.spec.placements[0].is_partial()
                dist.sum(zz).backward()
                all_reduces.append(backend.stand_in.all_reduces - before)
                values += [t.local_tensor(0).tobytes() for t in (zz, w.grad, b.grad)]
                calls_per_step.append(list(calls))
                w.clear_grad()
                b.clear_grad()
        finally:
            if general:
                hooks.op_start_hooks.remove(listener)
    return calls_per_step, values, all_reduces


def test_a_call_that_reshards_an_input_takes_the_short_path_once_decided() -> None:
    """A decided call whose inputs must move first takes the short path from its second step
    on, with the same reshards (reused where made) and bit for bit the general path's values."""
    assert not _listening(), f"an earlier test left listeners installed: {_listening()}"
    short_calls, short_values, short_reduces = _row_parallel_steps(general=False)
    long_calls, long_values, long_reduces = _row_parallel_steps(general=True)
    assert "add" in short_calls[0] and "multiply" in short_calls[0]  # decided on the general path
    for later in short_calls[1:]:
        assert "add" not in later and "multiply" not in later, later
    assert all("multiply" in step for step in long_calls)
    assert short_reduces == long_reduces
    assert short_reduces[0] >= 1 and len(set(short_reduces)) == 1  # the same collectives every step
    assert short_values == long_values


def _plain_sig(sig: Any) -> Any:
    """A replay key with each decision as what it holds (each run's backend makes its own)."""
    if not isinstance(sig, tuple):
        return sig
    return tuple(
        (d.res, d.need, d.out_specs, d.rule_label, d.dtypes, d.reshard) if isinstance(d, dispatch.Decision) else d
        for d in sig
    )


def _node_fields(loss: dist.Tensor) -> list[tuple[Any, ...]]:
    """Every node behind ``loss``, parents first: what it records, with parents as positions."""
    order = _tape.topo_order(loss)
    position = {id(node): i for i, node in enumerate(order)}
    fields = []
    for node in order:
        ctx = node.ctx
        fields.append(
            (
                node.op,
                node.grad_fn,
                node.num_outputs,
                _plain_sig(node.sig),
                [
                    None if p is None else (position.get(id(p._grad_fn)), p._out_index, p.stop_gradient)
                    for p in node.parents
                ],
                dict(ctx.attrs),
                [None if t is None else (t.spec, t.dtype, t.local_tensor(0).tobytes()) for t in ctx.inputs],
                [None if t is None else (t.spec, t.dtype, t.local_tensor(0).tobytes()) for t in ctx.outputs],
                list(ctx.input_shapes),
                list(ctx.input_dtypes),
                list(ctx.needs_grad),
                ctx.input_specs,
            )
        )
    return fields


def _same(t: dist.Tensor) -> dist.Tensor:
    return t


def _tapes(needs: tuple[bool, bool, bool], general: bool, saved_hook: bool) -> tuple[list[list[tuple[Any, ...]]], int]:
    """Three forward passes of ``small_graph.loss`` with ``needs`` saying which of its three
    leaves want a gradient; each pass's tape (``_node_fields``), then its backward.
    With them, how many op calls of the later passes' forwards took the general path."""
    listener = _Listening()
    tapes = []
    later_general = 0
    with dist.use_backend(SimBackend(1)), _counting_general() as calls:
        x, w, b = small_graph.leaves(needs)
        if general:
            hooks.op_start_hooks.append(listener)
        try:
            for step in range(3):
                hooked = dist.autograd.saved_tensors_hooks(_same, _same) if saved_hook else contextlib.nullcontext()
                calls.clear()
                with hooked:
                    loss = small_graph.loss(x, w, b)
                later_general += len(calls) if step else 0
                tapes.append(_node_fields(loss))
                if not loss.stop_gradient:
                    loss.backward()
                for t in (x, w, b):
                    t.clear_grad()
        finally:
            if general:
                hooks.op_start_hooks.remove(listener)
    return tapes, later_general


@given(needs=st.tuples(st.booleans(), st.booleans(), st.booleans()), saved_hook=st.booleans())
def test_the_short_paths_tape_nodes_are_the_general_paths(needs: tuple[bool, bool, bool], saved_hook: bool) -> None:
    """From its second call with a decision, the short path builds each tape node from what the
    first call's node held (``Decision.tapes``): every node must hold what the general path's
    holds (op, gradient function, replay key, parents, attributes, saved values, shapes,
    dtypes, needs and layouts), whichever inputs want a gradient, with or without a
    saved-tensor hook (under which it records as the general path does)."""
    assert not _listening(), f"an earlier test left listeners installed: {_listening()}"
    short, short_general = _tapes(needs, general=False, saved_hook=saved_hook)
    long, long_general = _tapes(needs, general=True, saved_hook=saved_hook)
    assert short_general == 0 and long_general > 0  # (the later forwards took the short path, or not at all)
    assert short == long
    assert all(bool(tape) == any(needs) for tape in short)  # nodes exactly when a leaf wants a gradient
