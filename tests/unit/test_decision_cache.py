"""The decision cache (``mpipar.ops.dispatch``): an op call's layouts are decided once per
signature, and a call that differs in anything its decision depends on -- an input's layout,
shape or dtype, an attribute's value or type -- is decided afresh, never handed an earlier one.

Each case makes a call twice (the second must reuse the decision: the rule is not asked again),
then the changed call, which must ask the rule, get its own layouts, shapes and dtypes, and the
values of the dense NumPy computation. The layout, shape and dtype cases run on both eager
paths: the simulator hosting every rank, and a process hosting one rank of the mesh (as under
MPI; its shard is checked).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import mpipar as dist
from mpipar.mesh import ProcessMesh
from mpipar.spmd import registry
from simulator import SimBackend

R, S0, S1 = dist.Replicate(), dist.Shard(0), dist.Shard(1)


class _RankZeroOnly(SimBackend):
    """Hosts rank 0 of each mesh only: dispatch's one-rank path, as in an MPI process."""

    def hosted_ranks(self, mesh: ProcessMesh) -> tuple[int, ...]:
        return (0,) if 0 in mesh.process_ids else ()


@pytest.fixture(params=["every rank", "rank 0 only"])
def backend(request: pytest.FixtureRequest) -> Iterator[SimBackend]:
    be = SimBackend(4) if request.param == "every rank" else _RankZeroOnly(4)
    with dist.use_backend(be):
        yield be


@pytest.fixture
def every_rank() -> Iterator[SimBackend]:
    """The simulator hosting every rank (the attribute cases read whole results)."""
    be = SimBackend(4)
    with dist.use_backend(be):
        yield be


@pytest.fixture
def rule_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ops whose rule dispatch asked, in order (a cached decision asks none)."""
    calls: list[str] = []
    for name in ("infer_forward", "infer_forward_reusing"):
        inner = getattr(registry, name)

        def counting(op: str, *args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            calls.append(op)
            return _inner(op, *args, **kwargs)

        monkeypatch.setattr(registry, name, counting)
    return calls


def _mesh() -> ProcessMesh:
    return dist.ProcessMesh([0, 1, 2, 3], dim_names=["x"])


def _local(t: dist.Tensor, backend: SimBackend) -> np.ndarray:
    """Rank 0's shard (every backend here hosts rank 0)."""
    return t.local_tensor(0) if isinstance(backend, _RankZeroOnly) else t.full_tensor()


def _expected_local(full: np.ndarray, t: dist.Tensor, backend: SimBackend) -> np.ndarray:
    """What ``_local`` must give for a tensor whose dense value is ``full``."""
    if not isinstance(backend, _RankZeroOnly):
        return full
    box = t.spec.boxes[0]
    return full[tuple(slice(a, b) for a, b in box)]


def _check(out: dist.Tensor, want: np.ndarray, placements: list[Any], backend: SimBackend) -> None:
    assert list(out.shape) == list(want.shape)
    assert out.dtype == want.dtype
    assert out.placements == placements
    np.testing.assert_allclose(_local(out, backend), _expected_local(want, out, backend), rtol=1e-6, atol=1e-6)


def _twice_then(
    rule_calls: list[str], op: str, first: Callable[[], dist.Tensor], changed: Callable[[], dist.Tensor]
) -> dist.Tensor:
    """Run ``first`` twice (the second must reuse the decision), then ``changed`` (it must not)."""
    first()
    asked = rule_calls.count(op)
    assert asked >= 1, f"the first {op} call asked no rule: the test does not reach the cache"
    first()
    assert rule_calls.count(op) == asked, f"a repeated {op} call was decided again: the cache is not used"
    out = changed()
    assert rule_calls.count(op) == asked + 1, f"a changed {op} call reused an earlier decision"
    return out


def _inputs(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def test_changed_layout_is_decided_afresh(backend: SimBackend, rule_calls: list[str]) -> None:
    a, b = _inputs((8, 8), np.float64)
    mesh = _mesh()

    def add(p: Any) -> dist.Tensor:
        return dist.add(dist.shard_tensor(a, mesh, [p]), dist.shard_tensor(b, mesh, [p]))

    out = _twice_then(rule_calls, "add", lambda: add(S0), lambda: add(S1))
    _check(out, a + b, [S1], backend)


def test_changed_shape_is_decided_afresh(backend: SimBackend, rule_calls: list[str]) -> None:
    mesh = _mesh()

    def add(rows: int) -> dist.Tensor:
        a, b = _inputs((rows, 4), np.float64)
        return dist.add(dist.shard_tensor(a, mesh, [S0]), dist.shard_tensor(b, mesh, [S0]))

    out = _twice_then(rule_calls, "add", lambda: add(8), lambda: add(12))
    a, b = _inputs((12, 4), np.float64)
    _check(out, a + b, [S0], backend)


def test_changed_dtype_is_decided_afresh(backend: SimBackend, rule_calls: list[str]) -> None:
    mesh = _mesh()

    def add(dtype: Any) -> dist.Tensor:
        a, b = _inputs((8, 4), dtype)
        return dist.add(dist.shard_tensor(a, mesh, [S0]), dist.shard_tensor(b, mesh, [S0]))

    out = _twice_then(rule_calls, "add", lambda: add(np.float64), lambda: add(np.float32))
    a, b = _inputs((8, 4), np.float32)
    _check(out, a + b, [S0], backend)


def test_changed_attribute_is_decided_afresh(every_rank: SimBackend, rule_calls: list[str]) -> None:
    x, _ = _inputs((8, 12), np.float64)
    mesh = _mesh()
    t = dist.shard_tensor(x, mesh, [S0])
    out = _twice_then(rule_calls, "sum", lambda: dist.sum(t, axis=1), lambda: dist.sum(t, axis=0))
    assert out.placements == [dist.Partial()]  # the rows were split: each rank holds a partial sum
    np.testing.assert_allclose(out.full_tensor(), x.sum(axis=0), rtol=1e-12)

    w, _ = _inputs((12, 12), np.float64, seed=1)
    wt = dist.shard_tensor(w, mesh, [S1])
    got = _twice_then(
        rule_calls,
        "matmul",
        lambda: dist.matmul(t, wt),
        lambda: dist.matmul(t, wt, transpose_y=True),
    )
    np.testing.assert_allclose(got.full_tensor(), x @ w.T, rtol=1e-12)


def test_attribute_of_another_type_is_decided_afresh(every_rank: SimBackend, rule_calls: list[str]) -> None:
    """``1`` and ``True`` are equal keys to Python (and hash alike), but another attribute."""
    x, _ = _inputs((8, 12), np.float64)
    t = dist.shard_tensor(x, _mesh(), [S0])
    out = _twice_then(rule_calls, "sum", lambda: dist.sum(t, axis=1), lambda: dist.sum(t, axis=True))
    np.testing.assert_allclose(out.full_tensor(), x.sum(axis=1), rtol=1e-12)
