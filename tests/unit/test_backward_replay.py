"""Backward replay (``mpipar.backward_replay``): a backward pass seen twice alike runs as its list
of kernels. It must compute bit for bit what the gradient functions compute, and run eagerly
wherever it cannot know that.

Each case trains the same model for a few steps twice on a backend hosting one rank (the only
place replay runs, as under MPI): with replay on and off. Losses, gradients, parameters and
optimizer states must agree bit for bit, and the run with replay on must have replayed the
passes it could (or none, where it must not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import small_graph
from hypothesis import given, settings
from hypothesis import strategies as st

import mpipar as dist
from mpipar import backward_replay
from mpipar.compile.trace import PlanRecorder
from mpipar.mesh import ProcessMesh
from mpipar.ops import dispatch
from mpipar.ops.dispatch import OpDef, apply, register_op
from simulator import SimBackend

STEPS = 5


@contextmanager
def _replay(enabled: bool) -> Iterator[None]:
    """Replay on or off, its counts from zero; and no ZeRO-3 parameter seen so far (a process that
    made one never replays: an earlier test in this worker may have)."""
    before = backward_replay.backward_replay_enabled()
    split_seen = dispatch.stored_split_seen[0]
    backward_replay.set_backward_replay(enabled)
    backward_replay.backward_replay_stats(reset=True)
    dispatch.stored_split_seen[0] = False
    try:
        yield
    finally:
        backward_replay.set_backward_replay(before)
        dispatch.stored_split_seen[0] = split_seen


def _model(seed: int, dtype: type, optimizer: str) -> tuple[Callable[[str], dist.Tensor], list[dist.Tensor], Any]:
    rng = np.random.default_rng(seed)
    dist.seed(seed)  # (dropout's keys: the same in the runs with replay on and off)
    b, n_in, hidden = 3, 4, 6
    mesh = ProcessMesh([0], dim_names=["mp"])
    x = dist.shard_tensor(rng.standard_normal((b, n_in)).astype(dtype), mesh, [dist.Replicate()])
    w1 = dist.shard_tensor(dist.Parameter(rng.standard_normal((n_in, hidden)).astype(dtype)), mesh, [dist.Shard(1)])
    b1 = dist.shard_tensor(dist.Parameter(rng.standard_normal(hidden).astype(dtype)), mesh, [dist.Shard(0)])
    w2 = dist.shard_tensor(dist.Parameter(rng.standard_normal((hidden, n_in)).astype(dtype)), mesh, [dist.Shard(0)])
    b2 = dist.shard_tensor(dist.Parameter(rng.standard_normal(n_in).astype(dtype)), mesh, [dist.Replicate()])
    params = [w1, b1, w2, b2]
    if optimizer == "sgd":
        opt: Any = dist.optimizer.SGD(learning_rate=0.05, parameters=params)
    elif optimizer == "momentum":
        opt = dist.optimizer.Momentum(learning_rate=0.05, momentum=0.9, parameters=params)
    else:
        opt = dist.optimizer.AdamW(learning_rate=0.01, parameters=params)
    relu = dist.nn.functional.relu

    def loss(shape: str) -> dist.Tensor:
        h = relu(dist.add(dist.matmul(x, w1), b1))
        z = dist.add(dist.matmul(h, w2), b2)
        if shape == "square":  # one value twice: the two saved inputs are one array
            return dist.mean(dist.multiply(z, z))
        if shape == "two values":  # the same layouts as "square", two arrays
            z2 = dist.add(dist.matmul(h, w2), b2)
            return dist.mean(dist.multiply(z, z2))
        if shape == "shared weight":  # a leaf reached twice, a node output consumed twice
            y = dist.matmul(dist.tanh(dist.add(dist.matmul(h, w2), b2)), dist.transpose(w2, [1, 0]))
            return dist.add(dist.sum(dist.scale(y, 0.25)), dist.mean(dist.multiply(h, h)))
        if shape == "dropout":  # a fresh key on the tape every step
            y = dist.matmul(dist.nn.functional.dropout(h, p=0.3), w2)
            return dist.mean(dist.add(y, b2))
        if shape == "split and join":  # a node of two outputs, a node of a list of inputs
            left, right = dist.split(h, 2, axis=1)
            y = dist.concat([dist.nn.functional.softmax(left, axis=-1), dist.multiply(right, right)], axis=1)
            return dist.mean(dist.add(dist.matmul(y, w2), b2))
        raise AssertionError(shape)

    return loss, params, opt


def _train(seed: int, dtype: type, optimizer: str, shape: str, enabled: bool) -> tuple[list[bytes], Any]:
    out: list[bytes] = []
    with dist.use_backend(SimBackend(1)), _replay(enabled):
        loss_fn, params, opt = _model(seed, dtype, optimizer)
        for _ in range(STEPS):
            loss = loss_fn(shape)
            loss.backward()
            out.append(loss.full_tensor().tobytes())
            out += [p.grad.full_tensor().tobytes() for p in params]
            opt.step()
            opt.clear_grad()
            out += [p.full_tensor().tobytes() for p in params]
        for state in opt._states.values():
            out += [v.full_tensor().tobytes() for _, v in sorted(state.items()) if isinstance(v, dist.Tensor)]
        return out, backward_replay.backward_replay_stats()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float32, np.float64]),
    optimizer=st.sampled_from(["sgd", "momentum", "adamw"]),
    shape=st.sampled_from(["square", "two values", "shared weight", "split and join", "dropout"]),
)
def test_replayed_backward_is_bit_identical(seed: int, dtype: type, optimizer: str, shape: str) -> None:
    on, stats_on = _train(seed, dtype, optimizer, shape, enabled=True)
    off, stats_off = _train(seed, dtype, optimizer, shape, enabled=False)
    assert on == off
    # Two recordings agree, every pass after them is replayed; off, none is.
    assert (stats_on.recorded, stats_on.replayed, stats_on.refused) == (2, STEPS - 2, {})
    assert (stats_off.recorded, stats_off.replayed) == (0, 0)


def _unchanged_leaves(needs: tuple[bool, bool, bool], enabled: bool) -> tuple[list[bytes], Any]:
    """Four passes of ``small_graph.loss``, its leaves never updated and ``needs`` saying which
    of them want a gradient; every gradient as bytes."""
    out: list[bytes] = []
    with dist.use_backend(SimBackend(1)), _replay(enabled):
        x, w, b = small_graph.leaves(needs)
        for _ in range(4):
            small_graph.loss(x, w, b).backward()
            out += [b"none" if t.grad is None else t.grad.full_tensor().tobytes() for t in (x, w, b)]
            for t in (x, w, b):
                t.clear_grad()
        return out, backward_replay.backward_replay_stats()


@given(needs=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any))
def test_leaves_that_want_no_gradient_replay_bit_identically(needs: tuple[bool, bool, bool]) -> None:
    """Ops reading only values that want no gradient record no node, and a reshard's local step
    may hand back a saved array as it is. (The recording once took such an array, read again,
    for one value saved twice, and compiled a check of a slot no pass saves: an IndexError.)"""
    on, stats_on = _unchanged_leaves(needs, enabled=True)
    off, _ = _unchanged_leaves(needs, enabled=False)
    assert on == off
    assert (stats_on.recorded, stats_on.replayed, stats_on.refused) == (2, 2, {})


def test_one_value_twice_and_two_values_share_no_program() -> None:
    """``z * z`` and ``z * z2`` (same layouts) alternate: each is its own graph, and each is
    computed right (a program reading one array twice must never be given two)."""
    with dist.use_backend(SimBackend(1)):
        results = {}
        for enabled in (True, False):
            with _replay(enabled):
                loss_fn, params, _ = _model(3, np.float64, "sgd")
                got = []
                for i in range(6):
                    loss = loss_fn("square" if i % 2 else "two values")
                    loss.backward()
                    got += [p.grad.full_tensor().tobytes() for p in params]
                    for p in params:
                        p.clear_grad()
                results[enabled] = got
                stats = backward_replay.backward_replay_stats()
                if enabled:
                    assert stats.replayed == 2  # the fifth and sixth passes: each graph seen twice before
        assert results[True] == results[False]


def test_user_gradient_is_never_replayed() -> None:
    """A user-registered op's gradient runs the user's Python: every pass calls it."""
    calls = []

    def kernel(ctx: Any, a: np.ndarray) -> np.ndarray:
        return a * 3.0

    def grad(ctx: Any, grads: list[Any]) -> list[Any]:
        calls.append(1)
        return [dist.scale(grads[0], 3.0)]

    register_op(OpDef("test_times_three", kernel, grad=grad, rule="abs"))
    with dist.use_backend(SimBackend(1)), _replay(True):
        mesh = ProcessMesh([0], dim_names=["mp"])
        w = dist.shard_tensor(dist.Parameter(np.arange(4.0)), mesh, [dist.Replicate()])
        for _ in range(4):
            loss = dist.sum(apply("test_times_three", [w]))
            loss.backward()
            assert np.array_equal(w.grad.full_tensor(), np.full(4, 3.0))
            w.clear_grad()
        stats = backward_replay.backward_replay_stats()
    assert len(calls) == 4
    assert (stats.recorded, stats.replayed, stats.eager) == (0, 0, 4)


def test_dropout_replays_with_each_steps_mask() -> None:
    """Dropout's key changes every step, but its gradient reads only the mask it saved
    (``OpDef.grad_attrs``): its graphs repeat, and each replayed pass uses that step's mask."""
    with dist.use_backend(SimBackend(1)):
        grads = {}
        for enabled in (True, False):
            with _replay(enabled):
                dist.seed(5)
                mesh = ProcessMesh([0], dim_names=["mp"])
                w = dist.shard_tensor(dist.Parameter(np.linspace(0.0, 1.0, 8)), mesh, [dist.Replicate()])
                got = []
                for _ in range(6):
                    loss = dist.sum(dist.nn.functional.dropout(dist.multiply(w, w), p=0.5))
                    loss.backward()
                    got.append(w.grad.full_tensor().tobytes())
                    w.clear_grad()
                grads[enabled] = got
                if enabled:
                    assert backward_replay.backward_replay_stats().replayed == 4
        assert grads[True] == grads[False]
        assert len(set(grads[True])) == 6  # a new mask every step


def test_graphs_that_never_repeat_back_off() -> None:
    """A new shape every step gives a new graph every step: recording stops after a few misses
    (then one pass in ``BACKOFF_EVERY``), and every step is still exact."""
    with dist.use_backend(SimBackend(1)):
        grads = {}
        for enabled in (True, False):
            with _replay(enabled):
                mesh = ProcessMesh([0], dim_names=["mp"])
                got = []
                for k in range(backward_replay.MISSES_BEFORE_BACKOFF + 4):
                    w = dist.shard_tensor(dist.Parameter(np.linspace(0.0, 1.0, k + 2)), mesh, [dist.Replicate()])
                    dist.sum(dist.tanh(dist.multiply(w, w))).backward()
                    got.append(w.grad.full_tensor().tobytes())
                grads[enabled] = got
                stats = backward_replay.backward_replay_stats()
                if enabled:
                    assert (stats.replayed, stats.recorded) == (0, backward_replay.MISSES_BEFORE_BACKOFF)
        assert grads[True] == grads[False]


def test_listeners_and_retained_graphs() -> None:
    """An op hook (a plan being traced) sees every backward op: no replay while it listens. A
    retained graph is replayed without releasing its nodes, so a second pass over it works."""
    with dist.use_backend(SimBackend(1)), _replay(True):
        model, params, _ = _model(1, np.float64, "sgd")

        def loss_fn() -> dist.Tensor:
            return model("square")

        for _ in range(3):
            loss = loss_fn()
            loss.backward()
            for p in params:
                p.clear_grad()
        assert backward_replay.backward_replay_stats().replayed == 1
        with PlanRecorder():
            loss = loss_fn()
            loss.backward()
        assert backward_replay.backward_replay_stats().replayed == 1
        for p in params:
            p.clear_grad()
        loss = loss_fn()
        loss.backward(retain_graph=True)
        once = [p.grad.full_tensor().copy() for p in params]
        loss.backward()
        assert backward_replay.backward_replay_stats().replayed == 3
        for p, g in zip(params, once, strict=True):
            assert np.array_equal(p.grad.full_tensor(), g + g)


def test_switch_and_environment() -> None:
    with _replay(False):
        assert not backward_replay.backward_replay_enabled()
    from mpipar.env import env_flag

    assert env_flag("MPIPAR_BACKWARD_REPLAY", True, {"MPIPAR_BACKWARD_REPLAY": "off"}) is False
    with pytest.raises(ValueError, match="MPIPAR_BACKWARD_REPLAY"):
        env_flag("MPIPAR_BACKWARD_REPLAY", True, {"MPIPAR_BACKWARD_REPLAY": "sometimes"})
